"""The KV store: blocks of KV in a preallocated arena, found by content, kept by LRU, held by leases.

Usable on its own::

    store = KvStore(KvLayout(30, 3, 64), block_tokens=64, capacity_bytes=1 << 30)
    ids = BlockHasher("smollm2", "float32", 64).ids(prompt_ids)
    store.put(ids[:2], keys, values)        # per layer, token-major (tokens, kv_heads, head_dim)
    hit = store.lookup(ids)                 # 2: the longest cached prefix, in blocks
    keys, values = store.get(ids[:hit])

and, for a request that reads a prefix and writes the rest in place (what the kv-shuttle and the
colocated worker do), :meth:`KvStore.lease`: it holds the cached prefix and hands out free slots
for the blocks still to come; :meth:`KvStore.commit` indexes each one once its bytes are in,
:meth:`KvStore.release` lets them go (and frees what was never committed). A holder that
writes its slots from another process, which may still be writing when the lease ends unfinished
(a cancelled request's prefill, or decode attending in the store's own blocks), releases with a
quarantine: those slots are reused only after it.

Rules:

- a block id names its content (:mod:`pdflow.kv.blocks`), so a stored block is never rewritten;
  committing an id that is already stored keeps the stored one;
- nothing leased is evicted or overwritten; a lease has a deadline (:meth:`KvStore.renew` moves
  it on, :meth:`KvStore.expire` drops the leases of holders that died). Lease and release are
  the store's only words for holding blocks: :meth:`KvStore.grow_lease` adds to a lease,
  :meth:`KvStore.lease_block` holds one block for a reader without a lease of its own;
- eviction is LRU over unleased blocks without cached children (a child goes before its parent:
  a block whose parent is gone can never be a prefix hit); above ``high_watermark`` of the slots
  in use it evicts down to ``low_watermark``, and a full store evicts rather than refuse; only a
  request that cannot fit even then gets :class:`StoreFull`;
- every committed block keeps a checksum per layer and kind; a lease verifies the prefix it holds
  and drops a block that fails (with every block below it), so the request recomputes it;
- every committed block has a version (a counter over the store, carried to and from the disk
  tier), and may have an expiry (``block_ttl_s`` for the store, ``keep_s`` for one lease's
  blocks: 0 keeps none). An expired block is never found again and its slot is reclaimed; one
  that a lease still holds stays readable to that lease until it is released. :meth:`KvStore.put` with
  ``replace`` makes a new version of a stored block; a reader of the old one that leased it keeps
  its bytes; :meth:`KvStore.get` with ``versions`` raises :class:`~pdflow.kv.outcomes.Miss`,
  :class:`~pdflow.kv.outcomes.VersionMismatch` or :class:`~pdflow.kv.outcomes.Corrupted`;
- :meth:`KvStore.forget` drops blocks on demand (a prefix and everything built on it, or all);
- with a ``codec`` (:mod:`pdflow.kv.codecs`), the arena holds each block encoded (int8: 3.9x the
  blocks in the same memory): :meth:`put`, :meth:`write` and :meth:`read` encode and decode,
  chunks from other stages arrive encoded (:mod:`pdflow.kv.chunks`), and checksums cover the
  encodings.

Not thread-safe: one event loop (or one thread) owns a store.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pdflow.kv.arena import ArenaLayout, anonymous_memory
from pdflow.kv.blocks import BlockId, descendants
from pdflow.transports.checksum import checksum
from pdflow.kv.codecs import KvCodec
from pdflow.kv.holdings import Journal
from pdflow.kv.layout import KEYS, VALUES, KvLayout, torch_dtype
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.outcomes import Corrupted, Miss, VersionMismatch
from pdflow.transports.regions import byte_view

__all__ = ["KvStore", "Lease", "StoreFull", "StoreStats"]


class StoreFull(RuntimeError):
    """A request's KV does not fit in the store even with everything unleased evicted."""


@dataclass(slots=True, eq=False)
class _Block:
    id: BlockId
    slot: int
    parent: _Block | None
    tick: int
    checksums: list[int]
    version: int
    expires: float = math.inf  # on the store's clock
    children: int = 0
    leases: int = 0  # how many leases (and lease_block readers) hold it
    detached: bool = False  # dropped from the index while leased: its slot is freed at its last release


@dataclass(slots=True, eq=False)
class Lease:
    """One holder's blocks and slots. ``slots[i]`` holds block ``i`` of ``ids`` (then the extra
    slots); the first ``hit`` blocks were cached, the rest are the holder's to write."""

    owner: Hashable
    ids: list[BlockId]
    hit: int
    slots: list[int]
    deadline: float
    blocks: list[_Block] = field(default_factory=list)  # the indexed blocks it holds: its hit, then its commits
    private: set[int] = field(default_factory=set)  # slots written by the holder, not (yet) indexed
    keep_s: float | None = None  # how long the blocks it commits are kept (None: the store's block_ttl_s)

    @property
    def new_slots(self) -> list[int]:
        """The slots after the cached prefix: where the holder writes."""
        return self.slots[self.hit :]


@dataclass(frozen=True, slots=True)
class StoreStats:
    blocks_total: int
    blocks_used: int  # indexed, plus slots leased for writing
    blocks_cached: int  # indexed
    bytes_total: int
    bytes_used: int
    block_tokens: int
    lookups: int
    hits: int  # lookups that found at least one block
    misses: int
    queried_tokens: int  # of the prompts lookups were for
    hit_blocks: int
    hit_tokens: int
    commits: int
    evictions: int
    checksum_failures: int
    leases: int
    leased_blocks: int  # indexed blocks that a lease holds
    blocks_quarantined: int  # released by a holder that may still be writing them: free after a while
    expired: int  # blocks dropped past their expiry
    forgotten: int  # blocks dropped on demand
    version: int  # the latest version given to a block

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class KvStore:
    def __init__(
        self,
        kv: KvLayout,
        block_tokens: int,
        capacity_bytes: int,
        *,
        memory: memoryview | None = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        lease_ttl_s: float = 300.0,
        block_ttl_s: float = math.inf,
        first_version: int = 1,
        clock: Callable[[], float] = time.monotonic,
        codec: KvCodec | None = None,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        self.layout = ArenaLayout.for_capacity(kv, block_tokens, capacity_bytes,
                                               None if codec is None or codec.lossless else codec)
        if self.layout.num_slots < 1:
            raise ValueError(f"capacity {capacity_bytes} bytes holds no block of {self.layout.block_bytes} bytes")
        raw = memory if memory is not None else anonymous_memory(self.layout.nbytes)
        self.memory = torch.frombuffer(raw, dtype=torch.uint8)  # flat: what transports read and write
        if self.memory.numel() < self.layout.nbytes:
            raise ValueError(f"memory of {self.memory.numel()} bytes is smaller than the arena's {self.layout.nbytes}")
        self._bytes = byte_view(raw)
        # (layers, 2, slots, block_tokens, kv_heads, head_dim); None where the blocks are encoded
        self.blocks = None if self.layout.encoded else self.layout.view(self.memory)
        # where slot 0's keys (values) of each layer start, in order, and their spans
        self._span_bases = [(self.layout.offset(layer, kind, 0), self.layout.span(kind))
                            for layer in range(kv.num_layers) for kind in (0, 1)]
        self.block_tokens = block_tokens
        self.high = int(high_watermark * self.layout.num_slots)
        self.low = int(low_watermark * self.layout.num_slots)
        self.lease_ttl_s = lease_ttl_s
        self.block_ttl_s = block_ttl_s
        self.clock = clock
        self.on_commit: Callable[[BlockId], None] | None = None  # told of every block indexed (the disk tier's writer)
        self.journal: Journal | None = None  # set: records every id indexed and dropped (cache-aware routing)
        self._free = list(range(self.layout.num_slots))  # a heap: low slots first, so runs stay long
        self._index: dict[BlockId, _Block] = {}
        self._evictable: list[tuple[int, BlockId]] = []  # heap of (tick, id); stale entries skipped
        self._leases: dict[Hashable, Lease] = {}
        self._quarantined: list[tuple[float, int]] = []  # heap of (free from, slot)
        self._expiring: list[tuple[float, int, BlockId]] = []  # heap of (expires, version, id) of mortal blocks
        self._leased = 0  # indexed blocks with leases > 0
        self._tick = 0
        self._version = first_version - 1
        self._counts = dict.fromkeys(("lookups", "hits", "misses", "queried_tokens", "hit_blocks", "commits",
                                      "evictions", "checksum_failures", "expired", "forgotten"), 0)

    # --- finding -------------------------------------------------------------------------------

    def lookup(self, ids: Sequence[BlockId]) -> int:
        """How many leading blocks of ``ids`` are cached (and mark them used)."""
        hit = self._prefix(ids)
        self._count_lookup(hit, len(ids) * self.block_tokens)
        return hit

    def block_ids(self) -> list[BlockId]:
        """Every block id indexed now."""
        return list(self._index)

    def __contains__(self, block_id: BlockId) -> bool:
        block = self._index.get(block_id)
        return block is not None and block.expires > self.clock()

    def _prefix(self, ids: Sequence[BlockId]) -> int:
        hit, now = 0, self.clock()
        for block_id in ids:
            block = self._index.get(block_id)
            if block is None:
                break
            if block.expires <= now:  # never served: gone, with what hangs from it
                self._counts["expired"] += self._drop_trees({block_id})
                break
            self._touch(block)
            hit += 1
        return hit

    def versions(self, ids: Sequence[BlockId]) -> list[int]:
        """The versions of the leading stored blocks of ``ids`` (what a reader records to read later)."""
        out = []
        for block_id in ids:
            if block_id not in self:
                break
            out.append(self._index[block_id].version)
        return out

    def block_info(self, block_id: BlockId) -> tuple[int, BlockId | None, int, float] | None:
        """(slot, parent id, version, expiry on the store's clock) of a stored block, or None."""
        block = self._index.get(block_id)
        if block is None:
            return None
        return block.slot, None if block.parent is None else block.parent.id, block.version, block.expires

    def _count_lookup(self, hit: int, queried_tokens: int) -> None:
        self._counts["lookups"] += 1
        self._counts["queried_tokens"] += queried_tokens
        self._counts["hits" if hit else "misses"] += 1
        self._counts["hit_blocks"] += hit

    # --- leases: a request reading a prefix and writing the rest in place ----------------------

    def lease(self, owner: Hashable, ids: Sequence[BlockId], extra_slots: int = 0, *, verify: bool = True,
              ttl_s: float | None = None, count: bool = True, write: bool = True,
              max_hit: int | None = None, keep_s: float | None = None, prompt_tokens: int | None = None) -> Lease:
        """Hold the longest cached prefix of ``ids`` and take a slot for each block after it, plus
        ``extra_slots`` (e.g. a partial last block), evicting as needed.

        ``verify`` checks the prefix's checksums first: a block that fails is dropped (with the
        blocks below it) and the hit ends before it. Raises StoreFull when the slots cannot be
        found (nothing stays leased then) and ValueError if ``owner`` already holds a lease.
        ``count``: whether this is a lookup for the hit and miss stats. ``write=False``: a reader
        only, no slots taken (``slots`` is the hit's). ``max_hit``: at most this many blocks hit (the
        rest get slots to be written, e.g. a last block whose token must be computed anyway).
        ``keep_s``: how long the blocks this lease commits are kept (0: not at all; None: the
        store's ``block_ttl_s``). ``prompt_tokens``: the prompt the lookup is for, for the tokens
        queried (default: the whole blocks of ``ids``).
        """
        if owner in self._leases:
            raise ValueError(f"{owner!r} already holds a lease")
        hit = self._prefix(ids if max_hit is None else ids[:max_hit])
        if verify:
            for i in range(hit):
                if not self._verify(self._index[ids[i]]):
                    self._drop(self._index[ids[i]])
                    hit = i
                    break
        if count:
            self._count_lookup(hit, len(ids) * self.block_tokens if prompt_tokens is None else prompt_tokens)
        hit_blocks = [self._index[block_id] for block_id in ids[:hit]]
        for block in hit_blocks:
            self._lease_one(block)
        try:
            fresh = self._take(len(ids) - hit + extra_slots) if write else []
        except StoreFull:
            for block in hit_blocks:
                self._release_one(block)
            raise
        deadline = self.clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)
        lease = Lease(owner, list(ids), hit, [b.slot for b in hit_blocks] + fresh, deadline, hit_blocks, set(fresh),
                      keep_s)
        self._leases[owner] = lease
        return lease

    def get_lease(self, owner: Hashable) -> Lease | None:
        return self._leases.get(owner)

    def lease_owners(self) -> list[Hashable]:
        return list(self._leases)

    def renew(self, owner: Hashable, ttl_s: float | None = None) -> None:
        lease = self._leases.get(owner)
        if lease is not None:
            lease.deadline = self.clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)

    def grow_lease(self, owner: Hashable, extra_slots: int = 0, ids: Sequence[BlockId] | None = None) -> list[int]:
        """Grow ``owner``'s lease: ``extra_slots`` more slots for it to write (appended to
        ``slots``; StoreFull if they cannot be found), and/or longer ``ids`` (which must start with
        the lease's own), so that blocks its holder wrote past them can be committed in place.
        Returns the new slots."""
        lease = self._leases[owner]
        if ids is not None:
            if list(ids[: len(lease.ids)]) != lease.ids:
                raise ValueError("the new ids do not extend the lease's own")
            lease.ids = list(ids)
        fresh = self._take(extra_slots) if extra_slots else []
        lease.slots += fresh
        lease.private.update(fresh)
        return fresh

    def commit(self, lease: Lease, index: int, *, replace: bool = False, version: int | None = None,
               keep_s: float | None = None, checksums: list[int] | None = None) -> bool:
        """Index block ``index`` of ``lease`` (its bytes are in ``lease.slots[index]``); the lease
        keeps holding it. False when it was not indexed: its parent is gone, the id is stored already
        (the stored copy stays, unless ``replace``: then this is its new version; this slot is
        freed at release), or the lease keeps nothing. ``version`` and ``keep_s`` (else the lease's)
        are for a block coming back from another tier with its own. ``checksums``: the slot's
        spans' (:meth:`span_checksum`, in :meth:`slot_spans`' order), taken as each span landed,
        so that committing a request's blocks at once does not read them all again."""
        if checksums is not None and len(checksums) != len(self._span_bases):
            raise ValueError(f"a block has {len(self._span_bases)} spans, got {len(checksums)} checksums")
        slot = lease.slots[index]
        block_id = lease.ids[index]
        keep = keep_s if keep_s is not None else lease.keep_s if lease.keep_s is not None else self.block_ttl_s
        old = self._index.get(block_id)
        if slot not in lease.private or (old is not None and not replace) or keep <= 0:
            return False
        parent = None
        if index:
            parent = self._index.get(lease.ids[index - 1])
            if parent is None:
                return False
        if version is None:
            version = self._version = self._version + 1
        else:
            self._version = max(self._version, version)
        block = _Block(block_id, slot, parent, self._next_tick(),
                       list(checksums) if checksums is not None else self._checksums(slot), version,
                       self.clock() + keep)
        if old is not None:
            self._retire(old, block)
        self._index[block_id] = block
        if math.isfinite(block.expires):
            heapq.heappush(self._expiring, (block.expires, version, block_id))
        if parent is not None:
            parent.children += 1
        lease.private.discard(slot)
        self._lease_one(block)
        lease.blocks.append(block)
        self._counts["commits"] += 1
        if self.journal is not None:  # (after a new version's _retire recorded the old one's removal)
            self.journal.add(block_id)
        if self.on_commit is not None:
            self.on_commit(block_id)
        return True

    def release(self, owner: Hashable, quarantine_s: float = 0.0) -> bool:
        """Drop ``owner``'s lease: let its blocks go, free the slots it never committed (with
        ``quarantine_s``: only that long from now, for a writer that may not have stopped yet)."""
        lease = self._leases.pop(owner, None)
        if lease is None:
            return False
        for block in lease.blocks:
            self._release_one(block)
        until = self.clock() + quarantine_s
        for slot in lease.private:
            if quarantine_s > 0:
                heapq.heappush(self._quarantined, (until, slot))
            else:
                heapq.heappush(self._free, slot)
        lease.blocks, lease.private = [], set()
        return True

    def expire(self, quarantine_s: float = 0.0) -> list[Hashable]:
        """Release every lease past its deadline (as :meth:`release`); their owners."""
        now = self.clock()
        self._reclaim()
        gone = [owner for owner, lease in self._leases.items() if lease.deadline <= now]
        for owner in gone:
            self.release(owner, quarantine_s)
        self._expire_blocks(now)
        return gone

    def _expire_blocks(self, now: float) -> None:
        """Drop every block past its expiry (leased ones stay readable to their holders)."""
        doomed = set()
        while self._expiring and self._expiring[0][0] <= now:
            _, version, block_id = heapq.heappop(self._expiring)
            block = self._index.get(block_id)
            if block is not None and block.version == version:
                doomed.add(block_id)
        if doomed:
            self._counts["expired"] += self._drop_trees(doomed)

    def forget(self, ids: Sequence[BlockId] | None = None) -> int:
        """Drop blocks ``ids`` and every block built on them (None: every block); how many went.
        Leased ones stay readable to their holders, then their slots are freed."""
        roots = set(self._index) if ids is None else {block_id for block_id in ids if block_id in self._index}
        n = self._drop_trees(roots) if roots else 0
        self._counts["forgotten"] += n
        return n

    # --- the plain API: whole blocks in and out -------------------------------------------------

    def put(self, ids: Sequence[BlockId], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *,
            replace: bool = False, keep_s: float | None = None) -> int:
        """Store blocks ``ids`` (a chain: ``ids[0]``'s parent, if any, must be stored) from
        per-layer keys and values, each ``(len(ids) * block_tokens, kv_heads, head_dim)``.
        ``replace``: blocks stored already get these bytes as a new version. Returns how many were
        stored. Raises StoreFull."""
        owner = LeaseOwner(f"put:{id(ids)}", LeaseKind.WRITE)  # (unique while this call holds it)
        lease = self.lease(owner, ids, verify=False, count=False, max_hit=0 if replace else None, keep_s=keep_s)
        try:
            bt = self.block_tokens
            for i in range(lease.hit, len(ids)):
                self._write_block(lease.slots[i], [k[i * bt : (i + 1) * bt] for k in keys],
                                  [v[i * bt : (i + 1) * bt] for v in values])
            return sum(self.commit(lease, i, replace=replace) for i in range(lease.hit, len(ids)))
        finally:
            self.release(owner)

    def get(self, ids: Sequence[BlockId], versions: Sequence[int] | None = None
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of blocks ``ids`` (checksums verified): per layer, keys and values
        ``(len(ids) * block_tokens, kv_heads, head_dim)``. Raises :class:`Miss` for a block not
        stored (or expired), :class:`VersionMismatch` if ``versions`` (what the reader recorded) names
        another one than is stored, :class:`Corrupted` for a block failing its checksum (dropped)."""
        blocks = []
        for i, block_id in enumerate(ids):
            if block_id not in self:
                raise Miss(block_id)
            block = self._index[block_id]
            if versions is not None and block.version != versions[i]:
                raise VersionMismatch(block_id, f"version {versions[i]} was replaced by {block.version}")
            if not self._verify(block):
                self._drop(block)
                raise Corrupted(block_id)
            blocks.append(block)
        for block in blocks:
            self._touch(block)
        return self.read([block.slot for block in blocks], len(ids) * self.block_tokens)

    def read(self, slots: Sequence[int], num_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The first ``num_tokens`` tokens held by ``slots``, copied: per layer keys and values."""
        kv = self.layout.kv
        if self.layout.encoded:
            return self._decoded(slots, num_tokens)
        index = torch.tensor(list(slots), dtype=torch.long)
        gathered = self.blocks.index_select(2, index)  # (layers, 2, n, block_tokens, heads, dim)
        flat = gathered.reshape(kv.num_layers, 2, -1, kv.num_kv_heads, kv.head_dim)[:, :, :num_tokens]
        return list(flat[:, 0]), list(flat[:, 1])

    def write(self, slots: Sequence[int], first: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Write per-layer keys and values of tokens ``first ..`` (block-aligned, token-major) into
        ``slots`` (``slots[i]`` holds block ``first // block_tokens + i``)."""
        bt = self.block_tokens
        n = keys[0].shape[0]
        for i, slot in enumerate(slots):
            a, b = i * bt, min((i + 1) * bt, n)
            if a >= b:
                break
            self._write_block(slot, [k[a:b] for k in keys], [v[a:b] for v in values])

    def _write_block(self, slot: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """One block's (or its first tokens') per-layer keys and values into ``slot``, encoded if
        the arena is."""
        layout = self.layout
        for layer in range(layout.kv.num_layers):
            for kind, x in ((KEYS, keys[layer]), (VALUES, values[layer])):
                if self.blocks is not None:
                    self.blocks[layer, kind, slot, : x.shape[0]] = x
                    continue
                data = layout.codec.encode_run(x.contiguous(), kind, self.block_tokens)
                at = layout.offset(layer, kind, slot)
                self.memory[at : at + data.numel()] = data

    def _decoded(self, slots: Sequence[int], num_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`read` of an encoded arena: each slot decoded as a whole block (what committed
        slots hold; a block's encoding depends on its token count), then cut to ``num_tokens``."""
        kv, bt, layout = self.layout.kv, self.block_tokens, self.layout
        count = -(-num_tokens // bt)
        out = ([], [])
        for layer in range(kv.num_layers):
            for kind in (KEYS, VALUES):
                x = torch.empty(count * bt, kv.num_kv_heads, kv.head_dim, dtype=torch_dtype(kv.dtype))
                for i, slot in enumerate(slots[:count]):
                    at = layout.offset(layer, kind, slot)
                    layout.codec.decode_run(self.memory[at : at + layout.span(kind)], kind, x[i * bt : (i + 1) * bt], bt)
                out[kind].append(x[:num_tokens])
        return out

    def lease_block(self, block_id: BlockId) -> object | None:
        """Hold one stored block, with no owner or deadline, until :meth:`release_block` of what
        this returns (None if not stored), which finds the block even if it was forgotten or
        replaced meanwhile."""
        block = self._index.get(block_id)
        if block is not None:
            self._lease_one(block)
        return block

    def release_block(self, leased: object) -> None:
        self._release_one(leased)

    def span(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the arena (what a transport sends from)."""
        return self._bytes[offset : offset + nbytes]

    def slot_spans(self, slot: int) -> list[memoryview]:
        """A slot's bytes, layer by layer, keys then values: a whole block, as the disk tier holds it."""
        return [self._bytes[base + slot * span : base + (slot + 1) * span] for base, span in self._span_bases]

    def span_checksum(self, slot: int, layer: int, kind: int) -> int:
        """The checksum of one span of a slot (``layer``'s keys, kind 0, or values, 1), as
        :meth:`commit` keeps it."""
        base, span = self._span_bases[2 * layer + kind]
        return checksum(self._bytes[base + slot * span : base + (slot + 1) * span])

    # --- stats ---------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        self._reclaim()
        total = self.layout.num_slots
        used = total - len(self._free)
        c = self._counts
        return StoreStats(
            blocks_total=total, blocks_used=used, blocks_cached=len(self._index),
            bytes_total=total * self.layout.block_bytes, bytes_used=used * self.layout.block_bytes,
            block_tokens=self.block_tokens, lookups=c["lookups"], hits=c["hits"], misses=c["misses"],
            queried_tokens=c["queried_tokens"], hit_blocks=c["hit_blocks"],
            hit_tokens=c["hit_blocks"] * self.block_tokens, commits=c["commits"],
            evictions=c["evictions"], checksum_failures=c["checksum_failures"], leases=len(self._leases),
            leased_blocks=self._leased, blocks_quarantined=len(self._quarantined), expired=c["expired"],
            forgotten=c["forgotten"], version=self._version,
        )

    # --- inside ----------------------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _touch(self, block: _Block) -> None:
        block.tick = self._next_tick()
        if self._evictable_now(block):
            heapq.heappush(self._evictable, (block.tick, block.id))

    @staticmethod
    def _evictable_now(block: _Block) -> bool:
        return not block.leases and not block.children and not block.detached

    def _lease_one(self, block: _Block) -> None:
        """One more lease holds ``block``."""
        if not block.leases and not block.detached:
            self._leased += 1
        block.leases += 1

    def _release_one(self, block: _Block) -> None:
        """One lease fewer holds ``block``: free at the last, if it left the index meanwhile."""
        block.leases -= 1
        if block.leases:
            return
        if block.detached:
            heapq.heappush(self._free, block.slot)
            return
        self._leased -= 1
        if not block.children:
            heapq.heappush(self._evictable, (block.tick, block.id))

    def _take(self, n: int) -> list[int]:
        """``n`` free slots (lowest first), evicting LRU blocks as needed, then down to the low
        watermark once above the high one."""
        self._reclaim()
        if n > self.layout.num_slots:
            raise StoreFull(f"{n} blocks of {self.layout.block_bytes} bytes exceed the whole store "
                            f"({self.layout.num_slots} blocks)")
        while len(self._free) < n:
            if not self._evict_one():
                raise StoreFull(f"{n} blocks needed, {len(self._free)} free and every other block leased "
                                f"by {len(self._leases)} leases or in quarantine ({len(self._quarantined)})")
        slots = [heapq.heappop(self._free) for _ in range(n)]
        slots.sort()
        if self.layout.num_slots - len(self._free) > self.high:
            while self.layout.num_slots - len(self._free) > self.low and self._evict_one():
                pass
        return slots

    def _reclaim(self) -> None:
        """Quarantined slots whose time is up are free again."""
        now = self.clock()
        while self._quarantined and self._quarantined[0][0] <= now:
            heapq.heappush(self._free, heapq.heappop(self._quarantined)[1])

    def _evict_one(self) -> bool:
        while self._evictable:
            tick, block_id = heapq.heappop(self._evictable)
            block = self._index.get(block_id)
            if block is None or block.tick != tick or not self._evictable_now(block):
                continue  # stale entry
            self._remove(block)
            heapq.heappush(self._free, block.slot)
            self._counts["evictions"] += 1
            return True
        return False

    def _remove(self, block: _Block) -> None:
        del self._index[block.id]
        if self.journal is not None:
            self.journal.remove(block.id)
        parent = block.parent
        if parent is not None:
            parent.children -= 1
            if self._evictable_now(parent):
                heapq.heappush(self._evictable, (parent.tick, parent.id))

    def _drop(self, bad: _Block) -> None:
        """Take ``bad`` and every block below it out of the index (a corrupt block's children can
        never be hit); leased ones are freed at their last release."""
        self._counts["checksum_failures"] += 1
        self._drop_trees({bad.id})

    def _drop_trees(self, roots: set[BlockId]) -> int:
        """Take ``roots`` and every block below them out of the index; how many. Leased ones are
        freed at their last release."""
        doomed = set(roots)
        if len(doomed) < len(self._index):
            doomed = descendants(doomed, ((block.id, None if block.parent is None else block.parent.id)
                                             for block in self._index.values()))
        for block_id in doomed:
            self._detach(self._index[block_id])
        return len(doomed)

    def _detach(self, block: _Block) -> None:
        """Out of the index; its slot is free now, or at its last release."""
        self._remove(block)
        if block.leases:
            block.detached = True
            self._leased -= 1
        else:
            heapq.heappush(self._free, block.slot)

    def _retire(self, old: _Block, new: _Block) -> None:
        """``new`` takes ``old``'s place (a new version): its children hang from ``new`` now."""
        for block in self._index.values():
            if block.parent is old:
                block.parent = new
                new.children += 1
        old.children = 0
        self._detach(old)

    def _checksums(self, slot: int) -> list[int]:
        return [checksum(span) for span in self.slot_spans(slot)]

    def _verify(self, block: _Block) -> bool:
        return self._checksums(block.slot) == block.checksums
