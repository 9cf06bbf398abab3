"""The memory store over a disk tier: blocks go down as they are committed, come back up on a hit.

:class:`DiskBackedStore` joins a :class:`~pdflow.kv.store.KvStore` (owned by one event loop) and a
:class:`~pdflow.kv.disk.DiskTier` (blocking I/O, used from worker threads):

- **Down (write-behind).** Every block the store commits is queued, and a writer task copies it
  to disk from its slot (one ``pwritev`` of its spans, no staging copy) in a worker thread,
  leasing it only while that write runs. So nothing on a request's path waits for the disk, an
  eviction from memory costs nothing (the block is on disk already), and a restart finds every
  block that was committed more than a moment before it (what was still queued is lost; counted
  as ``spill_missed`` when memory evicts it first). Writing at commit rather than at eviction is
  the choice that makes the restart keep what memory held; it costs disk bandwidth equal to the
  commit rate (about 45 MB/s of KV per 1,000 prefill tokens a second for SmolLM2 in fp32), far
  below a disk's.
- **Up (a hit on disk).** :meth:`DiskBackedStore.load` leases fresh slots for the blocks of a
  prefix that follow its memory hit and are on disk, reads them into those slots in a worker
  thread (each verified against its checksum and the version seen at lookup) and commits them
  with their own version and expiry; the first that fails (MISS, VERSION_MISMATCH, CORRUPTED)
  ends the run, and the request recomputes from there.
- **Both ways.** Memory hits touch the blocks' disk segments (disk eviction is LRU too);
  forgetting and expiry reach both tiers. A forget also voids what was on its way between the
  tiers when it came (a write in flight, a read not yet committed), so nothing forgotten comes back.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from pdflow.kv.blocks import BlockId
from pdflow.kv.disk import DiskTier
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.outcomes import Outcome
from pdflow.kv.store import KvStore, StoreFull

__all__ = ["DiskBackedStore", "TieringStats"]

log = structlog.get_logger()

_WRITE_BATCH = 16  # blocks a worker thread writes per call


@dataclass(frozen=True, slots=True)
class TieringStats:
    spill_queued: int  # committed, not yet on disk
    spilled_blocks: int
    spill_bytes: int
    spill_s: float  # worker time writing
    spill_missed: int  # left memory (evicted, expired, forgotten) before they were written
    disk_loads: int  # requests that read part of their prefix from disk
    disk_loaded_blocks: int
    disk_load_bytes: int
    disk_load_s: float
    disk_load_failed: int  # reads that ended a run: gone, replaced or corrupted on disk

    def as_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self.__slots__}


async def _thread_finishing(fn, *args):
    """``fn(*args)`` in a worker thread; if the caller is cancelled meanwhile, it still waits for
    the thread to finish before it goes on cancelled (the thread reads or writes slots that must
    not be freed under it)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


class DiskBackedStore:
    def __init__(self, store: KvStore, disk: DiskTier) -> None:
        if disk.block_bytes != store.layout.block_bytes:
            raise ValueError(f"the disk tier's blocks are {disk.block_bytes} bytes, the store's {store.layout.block_bytes}")
        self.store, self.disk = store, disk
        self._queue: deque[BlockId] = deque()
        self._queued = asyncio.Event()
        store.on_commit = self._on_commit
        self._counts = dict.fromkeys(("spilled_blocks", "spill_missed", "disk_loads", "disk_loaded_blocks",
                                      "disk_load_failed"), 0)
        self._seconds = {"spill": 0.0, "load": 0.0}
        self._writing = 0  # blocks handed to the writer thread, not yet written
        self._epoch = 0  # forgets so far: what was read or queued before one is void
        self._io = threading.Lock()  # a write of a block vs a forget on disk

    # --- down ------------------------------------------------------------------------------------

    def _on_commit(self, block_id: BlockId) -> None:
        self._queue.append(block_id)
        self._queued.set()

    async def run(self) -> None:
        """The writer: forever, the queued blocks to disk (run it as a task)."""
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                await self._spill_some()

    async def drain(self) -> None:
        """Write everything queued now, and wait for what the writer task is writing (what a clean
        shutdown or a test waits for)."""
        while self._queue or self._writing:
            if self._queue:
                await self._spill_some()
            else:
                await asyncio.sleep(0.005)

    async def _spill_some(self) -> None:
        batch, leased, epoch = [], [], self._epoch
        while self._queue and len(batch) < _WRITE_BATCH:
            block_id = self._queue.popleft()
            info = self.store.block_info(block_id)
            if info is None:
                self._counts["spill_missed"] += 1
                continue
            slot, parent, version, expires = info
            if self.disk.version(block_id) == version or self.disk.disabled:
                continue  # there already (it came from there), or the tier is off
            leased.append(self.store.lease_block(block_id))  # its slot is not reused while the thread reads it
            batch.append((block_id, parent, version, self._wall(expires), slot))
        if not batch:
            return
        self._writing += len(batch)
        try:
            await _thread_finishing(self._write, batch, epoch)
        finally:
            self._writing -= len(batch)
            for block in leased:
                self.store.release_block(block)

    def _wall(self, expires: float) -> float:
        """A store-clock expiry as a unix time (0: never)."""
        return 0.0 if math.isinf(expires) else time.time() + (expires - self.store.clock())

    def _write(self, batch, epoch: int) -> None:
        began = time.perf_counter()
        for block_id, parent, version, expires_at, slot in batch:
            with self._io:
                if self._epoch != epoch:
                    break  # a forget came: what it dropped must not reach the disk now
                written = self.disk.put(block_id, parent, self.store.slot_spans(slot), version=version,
                                        expires_at=expires_at)
            if written:
                self._counts["spilled_blocks"] += 1
        self._seconds["spill"] += time.perf_counter() - began

    # --- up --------------------------------------------------------------------------------------

    def memory_hit(self, ids: Sequence[BlockId], stop: int | None = None) -> int:
        """How many leading blocks of ``ids[:stop]`` memory holds."""
        return next((i for i, block_id in enumerate(ids[:stop]) if block_id not in self.store), len(ids[:stop]))

    def continues_on_disk(self, ids: Sequence[BlockId], stop: int | None = None) -> bool:
        """Is the block of ``ids[:stop]`` after memory's hit on disk (a load would bring some)?"""
        memory = self.memory_hit(ids, stop)
        return (stop is None or memory < stop) and bool(self.on_disk(ids, memory, memory + 1))

    def on_disk(self, ids: Sequence[BlockId], start: int, stop: int | None = None) -> list[int]:
        """The versions of the blocks ``ids[start:stop]`` that are on disk, up to the first that is not."""
        versions = []
        for block_id in ids[start:stop]:
            version = self.disk.version(block_id)
            if version is None or block_id not in self.disk:
                break
            versions.append(version)
        return versions

    async def load(self, request_id: str, ids: Sequence[BlockId], stop: int | None = None) -> int:
        """Bring the blocks of ``ids[:stop]`` that follow the memory hit and are on disk into
        memory, for request ``request_id``; how many came. They are committed unleased (the
        caller's lease holds them next)."""
        store, owner = self.store, LeaseOwner(request_id, LeaseKind.LOAD)
        memory = self.memory_hit(ids, stop)
        versions = self.on_disk(ids, memory, stop)
        if not versions:
            return 0
        wanted = list(ids[: memory + len(versions)])
        try:
            lease = store.lease(owner, wanted, verify=False, count=False)
        except StoreFull:
            return 0  # no room even after eviction: the request computes instead
        try:
            first, epoch = lease.hit, self._epoch  # (first == memory: nothing ran in between)
            began = time.perf_counter()
            outcomes = await _thread_finishing(self._read, wanted[first:], versions, lease.slots[first:])
            self._seconds["load"] += time.perf_counter() - began
            if self._epoch != epoch:
                return 0  # a forget came while reading: what was read may be what it dropped
            loaded = 0
            for i, (outcome, keep_s) in enumerate(outcomes):
                if outcome is not Outcome.HIT or not store.commit(lease, first + i, version=versions[i], keep_s=keep_s):
                    if outcome is not Outcome.HIT:
                        self._counts["disk_load_failed"] += 1
                    break
                loaded += 1
            self._counts["disk_loads"] += bool(loaded)
            self._counts["disk_loaded_blocks"] += loaded
            return loaded
        finally:
            store.release(owner)

    def _read(self, ids, versions, slots) -> list[tuple[Outcome, float | None]]:
        """Read blocks into slots (stopping at the first that fails); per block its outcome and how
        long it may still be kept (None: no expiry of its own)."""
        outcomes = self.disk.get_many(ids, [self.store.slot_spans(slot) for slot in slots[: len(ids)]], versions)
        out = []
        for block_id, outcome in zip(ids, outcomes):
            expires = self.disk.expires_at(block_id) if outcome is Outcome.HIT else 0.0
            out.append((outcome, None if not expires else expires - time.time()))
        return out

    # --- both ------------------------------------------------------------------------------------

    def touch(self, ids: Sequence[BlockId]) -> None:
        """Memory served these blocks: keep their disk segments young."""
        self.disk.touch(ids)

    async def forget(self, ids: Sequence[BlockId] | None = None) -> tuple[int, int]:
        """Drop blocks ``ids`` (and what is built on them; None: all) from memory and disk;
        (memory, disk) counts. On disk the descendants are found through the parents recorded
        with each block, and the bytes are overwritten."""
        self._epoch += 1
        in_memory = self.store.forget(ids)
        return in_memory, await asyncio.to_thread(self._forget_on_disk, ids)

    def _forget_on_disk(self, ids) -> int:
        with self._io:
            return self.disk.forget() if ids is None else self.disk.forget(self.disk.descendants(ids))

    def stats(self) -> TieringStats:
        c, s, block = self._counts, self._seconds, self.store.layout.block_bytes
        return TieringStats(
            spill_queued=len(self._queue) + self._writing, spilled_blocks=c["spilled_blocks"],
            spill_bytes=c["spilled_blocks"] * block,
            spill_s=round(s["spill"], 6), spill_missed=c["spill_missed"], disk_loads=c["disk_loads"],
            disk_loaded_blocks=c["disk_loaded_blocks"], disk_load_bytes=c["disk_loaded_blocks"] * block,
            disk_load_s=round(s["load"], 6), disk_load_failed=c["disk_load_failed"],
        )
