"""The KV store's disk tier: whole blocks in append-only segment files, found through an index
rebuilt from the files at start.

Usable on its own::

    disk = DiskTier(Path("/var/cache/pdflow/kv"), capacity_bytes=64 << 30, block_bytes=layout.block_bytes)
    disk.put(block_id, parent_id, payload)          # blocking: call it off the event loop
    outcome = disk.get(block_id, into)               # HIT (bytes in ``into``), MISS, CORRUPTED, ...

A payload (and ``into``) may be one buffer or a sequence of them (a block's spans in the store's
arena: written with one ``pwritev`` and read with one ``preadv``, no copy through a staging buffer).

Why segments. A block of SmolLM2 is 0.7–3 MB (16–64 tokens), of a 70B model far more, and a
store holds thousands: one file per block costs a create, an fsync of a directory entry and an
unlink per block, and scatters the data. A log of large segment files (``segment_bytes``, 256 MiB
by default) turns spilling into sequential appends, reading a block into one ``preadv`` at a known
offset, and eviction into deleting a whole file — the shape of Mooncake's and LMCache's local
disk backends. The price is that space comes back a segment at a time: eviction drops the least
recently used *segment* (the one whose most recent read, write or :meth:`DiskTier.touch` is
oldest; the store touches the blocks memory serves, so the segments of blocks in use stay young).

Records. Each block is one record: an 80-byte header (magic ``PDKB``, format version, flags,
the block id and its parent's, the payload's length and xxh3-64, the block's version, when it
expires, and the xxh3-64 of those fields) and the payload. A record enters the index only once it
is wholly written, so a reader never sees a half written block. At start every segment is scanned
and its records' headers checked; a torn tail (a crash mid-append) is cut off; a payload is
checked against its checksum on every read, and a block that fails is dropped from the index and
counted, never returned. Restarting keeps every whole record: the page cache survives a killed
process; a machine crash may lose the unsynced tail of the open segment, which the scan then cuts
(``fsync`` happens when a segment is closed).

Forgetting. A block forgotten on demand (:meth:`DiskTier.forget`) or past its expiry
(:meth:`DiskTier.expire`) is overwritten where it lies: its payload with zeros, its header with a
tombstone (the scan skips it, so it does not come back at the next start). Forgetting everything
deletes the segment files.

Failures. A write that fails for lack of space or permission (``ENOSPC``, ``EDQUOT``, ``EACCES``,
``EROFS``) turns the tier off with one warning (``disabled`` says why), and any other write error
(``EIO``) with one error; reads of what is already there go on. One process owns a directory
(an exclusive ``flock`` on its ``LOCK`` file): a second opener gets :class:`DiskInUse`.
Thread-safe: one lock guards the index and the files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import xxhash

from pdflow.kv.blocks import BlockId, descendants
from pdflow.kv.outcomes import Outcome

__all__ = ["DiskInUse", "DiskStats", "DiskTier", "Outcome"]

log = structlog.get_logger()

MAGIC = b"PDKB"
FORMAT = 2
TOMBSTONE = 1  # flag: forgotten; its payload is zeros and the scan skips it
_HAS_PARENT = 2
# magic, format, flags, id (lo, hi), parent (lo, hi), payload length, reserved, payload xxh3, version,
# expires (unix ms, 0: never)
_FIELDS = struct.Struct("<4sHHQQQQIIQQQ")
_HEADER = struct.Struct(f"<{_FIELDS.size}sQ")  # the fields and their xxh3-64: 80 bytes
HEADER_BYTES = _HEADER.size
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}
_MASK = (1 << 64) - 1
_ZEROS = bytes(1 << 20)
_RUN_BLOCKS = 64  # blocks to one run read (bounds how long a read holds the lock)
# bytes to one preadv: each piece is checksummed right after it lands, while it is in the CPU's
# cache (measured here from the page cache, a 2.8 MiB block into its spans in the arena, verified:
# one preadv 2.6-3.3 GB/s, pieces of ~0.5 MiB 3.6-3.8, a plain read without a check 3.8-4.6)
_PIECE_BYTES = 512 << 10
_MAX_IOVECS = 1000  # the kernel takes 1,024 buffers to a call


class DiskInUse(RuntimeError):
    """Another process owns the directory."""


@dataclass(slots=True)
class _Record:
    segment: int
    offset: int  # of the payload
    nbytes: int
    digest: int
    parent: BlockId | None
    version: int
    expires_ms: int  # 0: never


@dataclass(frozen=True, slots=True)
class DiskStats:
    blocks: int
    bytes_used: int  # of segment files, headers and dropped records included
    bytes_capacity: int
    segments: int
    writes: int
    reads: int
    hits: int
    misses: int
    corrupted: int  # records dropped on read (bad checksum, short read) or cut at start (torn)
    evicted_blocks: int
    forgotten: int  # on demand
    expired: int
    disabled: str  # why the tier stopped writing, "" while it works

    def as_dict(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in self.__slots__}


def _split(block_id: int) -> tuple[int, int]:
    return block_id & _MASK, block_id >> 64


def _header(block_id: BlockId, parent: BlockId | None, payload_len: int, digest: int, version: int,
            expires_ms: int, flags: int = 0) -> bytes:
    flags |= _HAS_PARENT if parent is not None else 0
    fields = _FIELDS.pack(MAGIC, FORMAT, flags, *_split(block_id), *_split(parent or 0), payload_len, 0, digest,
                          version, expires_ms)
    return _HEADER.pack(fields, xxhash.xxh3_64_intdigest(fields))


@dataclass(frozen=True, slots=True)
class _Parsed:
    block_id: BlockId
    parent: BlockId | None
    length: int
    digest: int
    version: int
    expires_ms: int
    flags: int


def _parse(raw: bytes) -> _Parsed | None:
    """A record's header, or None if it is not one."""
    if len(raw) < HEADER_BYTES:
        return None
    fields, digest = _HEADER.unpack(raw[:HEADER_BYTES])
    if xxhash.xxh3_64_intdigest(fields) != digest:
        return None
    magic, version, flags, id_lo, id_hi, parent_lo, parent_hi, length, _, payload_digest, block_version, expires = \
        _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT:
        return None
    parent = (parent_hi << 64 | parent_lo) if flags & _HAS_PARENT else None
    return _Parsed(id_hi << 64 | id_lo, parent, length, payload_digest, block_version, expires, flags)


def _buffers(data) -> list[memoryview]:
    """One buffer or a sequence of them, as byte views."""
    if isinstance(data, (list, tuple)):
        return [memoryview(part).cast("B") for part in data]
    return [memoryview(data).cast("B")]


def _digest(parts: list[memoryview]) -> int:
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def _read_verifying(fd: int, offset: int, blocks: list[list[memoryview]]) -> list[int] | None:
    """Read records back to back from ``offset`` (the first one's payload; a header lies between
    each two) into each block's buffers, in pieces of about ``_PIECE_BYTES``, each piece hashed
    right after it lands. Each block's payload digest, or None if the file ended first."""
    hashers = [xxhash.xxh3_64() for _ in blocks]
    sequence: list[tuple[memoryview, object]] = []  # (buffer, its block's hasher; None: a header)
    for k, parts in enumerate(blocks):
        if k:
            sequence.append((memoryview(bytearray(HEADER_BYTES)), None))
        sequence.extend((part, hashers[k]) for part in parts)
    i = 0
    while i < len(sequence):
        j, size = i, 0
        while j < len(sequence) and j - i < _MAX_IOVECS and (j == i or size + sequence[j][0].nbytes <= _PIECE_BYTES):
            size += sequence[j][0].nbytes
            j += 1
        if os.preadv(fd, [buffer for buffer, _ in sequence[i:j]], offset) != size:
            return None
        for buffer, hasher in sequence[i:j]:
            if hasher is not None:
                hasher.update(buffer)
        offset += size
        i = j
    return [hasher.intdigest() for hasher in hashers]


def _now_ms() -> int:
    return int(time.time() * 1000)


class DiskTier:
    """Blocks of ``block_bytes`` bytes in segment files under ``path``, at most about
    ``capacity_bytes`` of them (see the module doc)."""

    def __init__(self, path: Path, capacity_bytes: int, block_bytes: int, *, segment_bytes: int = 256 << 20) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.segment_bytes = max(segment_bytes, HEADER_BYTES + block_bytes)
        if capacity_bytes < 2 * self.segment_bytes:
            raise ValueError(f"disk capacity {capacity_bytes} bytes holds fewer than two segments of "
                             f"{self.segment_bytes} bytes (lower segment_bytes or raise the capacity)")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: dict[BlockId, _Record] = {}
        self._segment_blocks: dict[int, set[BlockId]] = {}
        self._segment_used: dict[int, int] = {}  # segment -> its last use (a tick)
        self._sizes: dict[int, int] = {}
        self._readers: dict[int, int] = {}  # segment -> a file descriptor open for reading
        self._tick = 0
        self._head: int | None = None  # the segment being appended to
        self._head_file = None
        self._counts = dict.fromkeys(("writes", "reads", "hits", "misses", "corrupted", "evicted_blocks",
                                      "forgotten", "expired"), 0)
        self.disabled = ""
        self.max_version = 0  # the highest version of any record found or written
        self.path.mkdir(parents=True, exist_ok=True)
        self._owner = self._own(self.path)
        self._rebuild()

    @staticmethod
    def _own(path: Path) -> int:
        fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskInUse(f"another process uses the KV disk tier at {path} (two stages cannot share one "
                            f"directory: give each its own disk_path)") from None
        return fd

    # --- the index from the files --------------------------------------------------------------

    def _file(self, segment: int) -> Path:
        return self.path / f"seg-{segment:08d}.pdkv"

    def _rebuild(self) -> None:
        """Scan every segment: index its whole records, cut a torn tail, count what was lost."""
        segments = sorted(int(p.stem[4:]) for p in self.path.glob("seg-*.pdkv") if p.stem[4:].isdigit())
        for segment in segments:
            self._segment_blocks[segment] = set()
            self._segment_used[segment] = self._next_tick()
            end = self._scan(segment)
            self._sizes[segment] = end
        expired = self._expire_locked(_now_ms())
        log.info("kv.disk.opened", path=str(self.path), blocks=len(self._index), segments=len(segments),
                 corrupted=self._counts["corrupted"], expired=expired)

    def _scan(self, segment: int) -> int:
        """Index the records of one segment; returns where its whole records end (the file is cut
        there if something torn follows)."""
        file = self._file(segment)
        size, at = file.stat().st_size, 0
        with open(file, "rb") as f:
            while at + HEADER_BYTES <= size:
                f.seek(at)
                parsed = _parse(f.read(HEADER_BYTES))
                if parsed is None or parsed.length != self.block_bytes or at + HEADER_BYTES + parsed.length > size:
                    break
                if not parsed.flags & TOMBSTONE:
                    self._forget(parsed.block_id)  # a later copy of the same block wins
                    self._index[parsed.block_id] = _Record(segment, at + HEADER_BYTES, parsed.length, parsed.digest,
                                                           parsed.parent, parsed.version, parsed.expires_ms)
                    self._segment_blocks[segment].add(parsed.block_id)
                self.max_version = max(self.max_version, parsed.version)
                at += HEADER_BYTES + parsed.length
        if at < size:
            self._counts["corrupted"] += 1
            log.warning("kv.disk.torn", segment=str(file), kept_bytes=at, dropped_bytes=size - at)
            try:
                os.truncate(file, at)
            except OSError as exc:
                log.warning("kv.disk.truncate_failed", segment=str(file), error=str(exc))
        return at

    # --- writing -----------------------------------------------------------------------------------

    def put(self, block_id: BlockId, parent: BlockId | None, payload, *, version: int = 0,
            expires_at: float = 0.0) -> bool:
        """Append block ``block_id`` (``payload``: ``block_bytes`` bytes, one buffer or a sequence);
        True once it is on disk and indexed, False if that version is there already or the tier is
        off. A new version of a stored block replaces it. ``expires_at``: a unix time after which
        it is never served (0: never). Evicts the least recently used segments beyond the capacity
        first. Blocking: call it off the event loop."""
        parts = _buffers(payload)
        nbytes = sum(part.nbytes for part in parts)
        if nbytes != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {nbytes}")
        digest = _digest(parts)
        expires_ms = int(expires_at * 1000) if expires_at else 0
        with self._lock:
            held = self._index.get(block_id)
            if self.disabled or (held is not None and held.version == version):
                return False
            try:
                segment, offset = self._room()
                header = _header(block_id, parent, nbytes, digest, version, expires_ms)
                written = os.pwritev(self._head_file.fileno(), [header, *parts], offset)
                if written != HEADER_BYTES + nbytes:  # the rest would not fit (the scan cuts this tail)
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: a short write, {written} of "
                                                f"{HEADER_BYTES + nbytes} bytes")
            except OSError as exc:  # full or unwritable; any other error (EIO) too, louder
                self.disabled = f"{exc.strerror or exc} ({self.path})"
                (log.warning if exc.errno in _FULL else log.error)(
                    "kv.disk.disabled", path=str(self.path), error=str(exc), hint="the store goes on in memory only")
                return False
            if held is not None:
                self._bury(block_id)  # the older version
            self._sizes[segment] = offset + HEADER_BYTES + nbytes
            self._index[block_id] = _Record(segment, offset + HEADER_BYTES, nbytes, digest, parent, version, expires_ms)
            self._segment_blocks[segment].add(block_id)
            self._segment_used[segment] = self._next_tick()
            self.max_version = max(self.max_version, version)
            self._counts["writes"] += 1
            return True

    def _room(self) -> tuple[int, int]:
        """The head segment and the offset where the next record goes (a new segment when the
        head is full), after evicting down to the capacity (call under the lock)."""
        record = HEADER_BYTES + self.block_bytes
        if self._head is None or self._sizes[self._head] + record > self.segment_bytes:
            self._close_head()
            self._head = max(self._sizes, default=0) + 1
            self._head_file = open(self._file(self._head), "ab")
            self._sizes[self._head] = 0
            self._segment_blocks[self._head] = set()
            self._segment_used[self._head] = self._next_tick()
        while sum(self._sizes.values()) + record > self.capacity_bytes and self._evict_segment():
            pass
        return self._head, self._sizes[self._head]

    def _close_head(self) -> None:
        if self._head_file is not None:
            try:
                os.fsync(self._head_file.fileno())
            finally:
                self._head_file.close()
                self._head_file = None

    def _evict_segment(self) -> bool:
        """Delete the least recently used segment other than the head; False if there is none."""
        others = [s for s in self._sizes if s != self._head]
        if not others:
            return False
        victim = min(others, key=self._segment_used.__getitem__)
        for block_id in self._segment_blocks.get(victim, set()).copy():
            if self._forget(block_id):
                self._counts["evicted_blocks"] += 1
        self._delete_segment(victim)
        return True

    def _delete_segment(self, segment: int) -> None:
        self._segment_blocks.pop(segment, None)
        self._sizes.pop(segment, None)
        self._segment_used.pop(segment, None)
        fd = self._readers.pop(segment, None)
        if fd is not None:
            os.close(fd)
        try:
            self._file(segment).unlink()
        except FileNotFoundError:
            pass

    # --- reading -----------------------------------------------------------------------------------

    def __contains__(self, block_id: BlockId) -> bool:
        record = self._index.get(block_id)
        return record is not None and not (record.expires_ms and record.expires_ms <= _now_ms())

    def parent(self, block_id: BlockId) -> BlockId | None:
        record = self._index.get(block_id)
        return None if record is None else record.parent

    def version(self, block_id: BlockId) -> int | None:
        """The stored version of a block (None if absent)."""
        record = self._index.get(block_id)
        return None if record is None else record.version

    def get(self, block_id: BlockId, into, version: int | None = None) -> Outcome:
        """Read block ``block_id`` into ``into`` (one writable buffer or a sequence, ``block_bytes``
        in all) and verify it. With ``version``: VERSION_MISMATCH if the block stored is another
        one. CORRUPTED drops it from the index (it is never served); ``into`` then holds garbage.
        Blocking: call it off the event loop."""
        parts = _buffers(into)
        nbytes = sum(part.nbytes for part in parts)
        if nbytes != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, the buffer {nbytes}")
        with self._lock:
            self._counts["reads"] += 1
            record = self._index.get(block_id)
            if record is not None and record.expires_ms and record.expires_ms <= _now_ms():
                self._bury(block_id)
                self._counts["expired"] += 1
                record = None
            if record is None:
                self._counts["misses"] += 1
                return Outcome.MISS
            if version is not None and record.version != version:
                return Outcome.VERSION_MISMATCH
            try:
                digests = _read_verifying(self._reader(record.segment), record.offset, [parts])
            except OSError as exc:
                log.warning("kv.disk.read_failed", block=f"{block_id:032x}", error=str(exc))
                digests = None
            if digests is None or digests[0] != record.digest:
                self._forget(block_id)
                self._counts["corrupted"] += 1
                log.warning("kv.disk.corrupted", block=f"{block_id:032x}", segment=record.segment)
                return Outcome.CORRUPTED
            self._segment_used[record.segment] = self._next_tick()
            self._counts["hits"] += 1
            return Outcome.HIT

    def get_many(self, ids, intos, versions=None) -> list[Outcome]:
        """Read blocks ``ids`` into ``intos`` (one destination each, as :meth:`get`), stopping at
        the first that is not a HIT (the list ends with its outcome). Blocks that lie one after the
        other in a segment are read as one sequential range (their headers into a scratch buffer),
        so small blocks written together come back in large reads. Blocking."""
        outcomes: list[Outcome] = []
        parts = [_buffers(into) for into in intos]
        i = 0
        while i < len(ids):
            with self._lock:
                j = self._run_end(ids, i, versions, parts)
                run = self._read_run(ids[i:j], parts[i:j]) if j - i > 1 else None
            if run is None:  # one block, or a run that did not read whole: block by block says why
                run = []
                for k in range(i, max(j, i + 1)):
                    run.append(self.get(ids[k], parts[k], None if versions is None else versions[k]))
                    if run[-1] is not Outcome.HIT:
                        break
            outcomes.extend(run)
            if outcomes[-1] is not Outcome.HIT:
                return outcomes
            i += len(run)
        return outcomes

    def _run_end(self, ids, i: int, versions, parts) -> int:
        """How far from ``ids[i]`` the records lie back to back in one segment, live and of the
        version asked (at most ``_RUN_BLOCKS``); ``i`` if ``ids[i]`` is not such a record (call
        under the lock)."""
        now, j, previous = _now_ms(), i, None
        while j < len(ids):
            record = self._index.get(ids[j])
            if record is None or (record.expires_ms and record.expires_ms <= now) or \
                    (versions is not None and record.version != versions[j]):
                break
            if previous is not None and (record.segment != previous.segment or
                                         record.offset != previous.offset + previous.nbytes + HEADER_BYTES):
                break
            if j - i == _RUN_BLOCKS:
                break
            previous = record
            j += 1
        return j

    def _read_run(self, ids, parts) -> list[Outcome] | None:
        """Records back to back in one segment, read as one range; each verified (call under the
        lock). None if the read came back short (the caller reads them one by one)."""
        records = [self._index[block_id] for block_id in ids]
        first = records[0]
        try:
            digests = _read_verifying(self._reader(first.segment), first.offset, parts)
        except OSError:
            digests = None
        if digests is None:
            return None
        outcomes = []
        for block_id, record, digest in zip(ids, records, digests):
            self._counts["reads"] += 1
            if digest != record.digest:
                self._forget(block_id)
                self._counts["corrupted"] += 1
                log.warning("kv.disk.corrupted", block=f"{block_id:032x}", segment=record.segment)
                outcomes.append(Outcome.CORRUPTED)
                return outcomes
            self._counts["hits"] += 1
            outcomes.append(Outcome.HIT)
        self._segment_used[first.segment] = self._next_tick()
        return outcomes

    def _reader(self, segment: int) -> int:
        fd = self._readers.get(segment)
        if fd is None:
            fd = self._readers[segment] = os.open(self._file(segment), os.O_RDONLY)
        return fd

    def expires_at(self, block_id: BlockId) -> float:
        """When a stored block expires (a unix time; 0: never, or absent)."""
        record = self._index.get(block_id)
        return 0.0 if record is None or not record.expires_ms else record.expires_ms / 1000

    def touch(self, ids) -> None:
        """Mark blocks used (memory served them): their segments are evicted later. Takes no lock
        (an event loop calls it; a race only makes the LRU order a little less exact)."""
        tick = self._next_tick()
        for block_id in ids:
            record = self._index.get(block_id)
            if record is not None and record.segment in self._segment_used:
                self._segment_used[record.segment] = tick

    def descendants(self, ids) -> set[BlockId]:
        """``ids`` that are stored and every stored block built on them (through recorded parents)."""
        with self._lock:
            return descendants((block_id for block_id in ids if block_id in self._index),
                               ((block_id, record.parent) for block_id, record in self._index.items()))

    # --- forgetting ----------------------------------------------------------------------------

    def forget(self, ids=None) -> int:
        """Forget blocks ``ids`` (every block when None), overwriting their bytes: zeros and a
        tombstone where they lie, or the segment files deleted. How many were there."""
        with self._lock:
            if ids is None:
                n = len(self._index)
                self._close_head()
                self._head = None
                for segment in list(self._sizes):
                    self._delete_segment(segment)
                self._index.clear()
            else:
                n = sum(self._bury(block_id) for block_id in ids)
            self._counts["forgotten"] += n
            return n

    def expire(self) -> int:
        """Forget (and overwrite) every block past its expiry; how many."""
        with self._lock:
            return self._expire_locked(_now_ms())

    def _expire_locked(self, now_ms: int) -> int:
        gone = [block_id for block_id, r in self._index.items() if r.expires_ms and r.expires_ms <= now_ms]
        for block_id in gone:
            self._bury(block_id)
        self._counts["expired"] += len(gone)
        return len(gone)

    def _bury(self, block_id: BlockId) -> bool:
        """Drop a block from the index and overwrite it on disk: a tombstone header (the scan skips
        it) and zeros for its payload (call under the lock)."""
        record = self._index.get(block_id)
        if record is None:
            return False
        self._forget(block_id)
        header = _header(block_id, record.parent, record.nbytes, 0, record.version, record.expires_ms, TOMBSTONE)
        try:
            fd = os.open(self._file(record.segment), os.O_WRONLY)
            try:
                os.pwrite(fd, header, record.offset - HEADER_BYTES)
                at, end = record.offset, record.offset + record.nbytes
                while at < end:
                    at += os.pwrite(fd, _ZEROS[: min(len(_ZEROS), end - at)], at)
            finally:
                os.close(fd)
        except OSError as exc:  # gone from the index all the same; the bytes stay until the segment goes
            log.warning("kv.disk.overwrite_failed", block=f"{block_id:032x}", error=str(exc))
        return True

    def _forget(self, block_id: BlockId) -> bool:
        record = self._index.pop(block_id, None)
        if record is None:
            return False
        self._segment_blocks.get(record.segment, set()).discard(block_id)
        return True

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # --- the rest --------------------------------------------------------------------------------

    def stats(self) -> DiskStats:
        with self._lock:
            c = self._counts
            return DiskStats(blocks=len(self._index), bytes_used=sum(self._sizes.values()),
                             bytes_capacity=self.capacity_bytes, segments=len(self._sizes), writes=c["writes"],
                             reads=c["reads"], hits=c["hits"], misses=c["misses"], corrupted=c["corrupted"],
                             evicted_blocks=c["evicted_blocks"], forgotten=c["forgotten"], expired=c["expired"],
                             disabled=self.disabled)

    def close(self) -> None:
        """Sync and close the segment being written, the readers and the directory's lock (idempotent)."""
        with self._lock:
            self._close_head()
            self._head = None
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()
            if self._owner >= 0:
                os.close(self._owner)
                self._owner = -1
