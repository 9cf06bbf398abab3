"""The KV store's disk tier: whole blocks in append-only segment files, found through an index
rebuilt from the files at start.

Usable on its own::

    disk = DiskTier(Path("/var/cache/pdflow/kv"), capacity_bytes=64 << 30, block_bytes=layout.block_bytes)
    disk.put(block_id, parent_id, payload)          # blocking: call it off the event loop
    outcome = disk.get(block_id, into)               # HIT (bytes in ``into``), MISS or CORRUPTED

Why segments. A block of SmolLM2 is 0.7–3 MB (16–64 tokens), of a 70B model far more, and a
store holds thousands: one file per block costs a create, an fsync of a directory entry and an
unlink per block, and scatters the data. A log of large segment files (``segment_bytes``, 256 MiB
by default) turns spilling into sequential appends, reading a block into one ``preadv`` at a known
offset, and eviction into deleting a whole file — the shape of Mooncake's and LMCache's local
disk backends. The price is that space comes back a segment at a time: eviction drops the least
recently used *segment* (the one whose most recent read or write is oldest), and a block read
from disk that goes back into memory is written again at the log's head if it is evicted again,
so what is used stays near the head.

Records. Each block is one record: a 64-byte header (magic ``PDKB``, format version, the block id
and its parent's, the payload's length and xxh3-64, and the xxh3-64 of those fields) and the
payload. A record enters the index only once it is wholly written, so a reader never sees a half
written block. At start every segment is scanned and its records' headers checked; a torn tail
(a crash mid-append) is cut off; a payload is checked against its checksum on every read, and a
block that fails is dropped from the index and counted, never returned. Restarting keeps every
whole record: the page cache survives a killed process; a machine crash may lose the unsynced
tail of the open segment, which the scan then cuts (``fsync`` happens when a segment is closed).

Failures. A write that fails for lack of space or permission (``ENOSPC``, ``EDQUOT``, ``EACCES``,
``EROFS``) turns the tier off with one warning (``disabled`` says why); reads of what is already
there go on. Thread-safe: one lock guards the index and the files.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import structlog
import xxhash

from pdflow.kv.blocks import BlockId

__all__ = ["DiskStats", "DiskTier", "Outcome"]

log = structlog.get_logger()

MAGIC = b"PDKB"
FORMAT = 1
# magic, format, reserved, id (lo, hi), parent (lo, hi), has parent, payload length, payload xxh3
_FIELDS = struct.Struct("<4sHHQQQQIIQ")
_HEADER = struct.Struct(f"<{_FIELDS.size}sQ")  # the fields and their xxh3-64: 64 bytes
HEADER_BYTES = _HEADER.size
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}
_MASK = (1 << 64) - 1


class Outcome(Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPTED = "corrupted"  # was on disk, failed its checksum (or could not be read): dropped


@dataclass(slots=True)
class _Record:
    segment: int
    offset: int  # of the payload
    nbytes: int
    digest: int
    parent: BlockId | None


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
    disabled: str  # why the tier stopped writing, "" while it works

    def as_dict(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in self.__slots__}


def _split(block_id: int) -> tuple[int, int]:
    return block_id & _MASK, block_id >> 64


def _header(block_id: BlockId, parent: BlockId | None, payload_len: int, digest: int) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT, 0, *_split(block_id), *_split(parent or 0), parent is not None,
                          payload_len, digest)
    return _HEADER.pack(fields, xxhash.xxh3_64_intdigest(fields))


def _parse(raw: bytes) -> tuple[BlockId, BlockId | None, int, int] | None:
    """(id, parent, payload length, payload digest) of a header, or None if it is not one."""
    if len(raw) < HEADER_BYTES:
        return None
    fields, digest = _HEADER.unpack(raw[:HEADER_BYTES])
    if xxhash.xxh3_64_intdigest(fields) != digest:
        return None
    magic, version, _, id_lo, id_hi, parent_lo, parent_hi, has_parent, length, payload_digest = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT:
        return None
    parent = (parent_hi << 64 | parent_lo) if has_parent else None
    return id_hi << 64 | id_lo, parent, length, payload_digest


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
        self._tick = 0
        self._head: int | None = None  # the segment being appended to
        self._head_file = None
        self._counts = dict.fromkeys(("writes", "reads", "hits", "misses", "corrupted", "evicted_blocks"), 0)
        self.disabled = ""
        self.path.mkdir(parents=True, exist_ok=True)
        self._rebuild()

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
        log.info("kv.disk.opened", path=str(self.path), blocks=len(self._index), segments=len(segments),
                 corrupted=self._counts["corrupted"])

    def _scan(self, segment: int) -> int:
        """Index the records of one segment; returns where its whole records end (the file is cut
        there if something torn follows)."""
        file = self._file(segment)
        size, at = file.stat().st_size, 0
        with open(file, "rb") as f:
            while at + HEADER_BYTES <= size:
                f.seek(at)
                parsed = _parse(f.read(HEADER_BYTES))
                if parsed is None:
                    break
                block_id, parent, length, digest = parsed
                if length != self.block_bytes or at + HEADER_BYTES + length > size:
                    break
                self._forget(block_id)  # a later copy of the same block wins
                self._index[block_id] = _Record(segment, at + HEADER_BYTES, length, digest, parent)
                self._segment_blocks[segment].add(block_id)
                at += HEADER_BYTES + length
        if at < size:
            self._counts["corrupted"] += 1
            log.warning("kv.disk.torn", segment=str(file), kept_bytes=at, dropped_bytes=size - at)
            try:
                os.truncate(file, at)
            except OSError as exc:
                log.warning("kv.disk.truncate_failed", segment=str(file), error=str(exc))
        return at

    # --- writing -----------------------------------------------------------------------------------

    def put(self, block_id: BlockId, parent: BlockId | None, payload) -> bool:
        """Append block ``block_id`` (``payload``: ``block_bytes`` bytes, any buffer); True once it
        is on disk and indexed, False if it was there already or the tier is off. Evicts the least
        recently used segments beyond the capacity first."""
        data = memoryview(payload).cast("B")
        if data.nbytes != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {data.nbytes}")
        digest = xxhash.xxh3_64_intdigest(data)
        with self._lock:
            if self.disabled or block_id in self._index:
                return False
            try:
                segment, offset = self._room()
                written = os.pwritev(self._head_file.fileno(), [_header(block_id, parent, data.nbytes, digest), data],
                                     offset)
                if written != HEADER_BYTES + data.nbytes:  # the rest would not fit (the scan cuts this tail)
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: a short write, {written} of "
                                                f"{HEADER_BYTES + data.nbytes} bytes")
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise
                self.disabled = f"{exc.strerror or exc} ({self.path})"
                log.warning("kv.disk.disabled", path=str(self.path), error=str(exc),
                            hint="the store goes on in memory only")
                return False
            self._sizes[segment] = offset + HEADER_BYTES + data.nbytes
            self._index[block_id] = _Record(segment, offset + HEADER_BYTES, data.nbytes, digest, parent)
            self._segment_blocks[segment].add(block_id)
            self._segment_used[segment] = self._next_tick()
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
        for block_id in self._segment_blocks.pop(victim, set()):
            if self._index.get(block_id) is not None and self._index[block_id].segment == victim:
                del self._index[block_id]
                self._counts["evicted_blocks"] += 1
        self._sizes.pop(victim)
        self._segment_used.pop(victim, None)
        try:
            self._file(victim).unlink()
        except FileNotFoundError:
            pass
        return True

    # --- reading -----------------------------------------------------------------------------------

    def __contains__(self, block_id: BlockId) -> bool:
        return block_id in self._index

    def parent(self, block_id: BlockId) -> BlockId | None:
        record = self._index.get(block_id)
        return None if record is None else record.parent

    def get(self, block_id: BlockId, into) -> Outcome:
        """Read block ``block_id`` into ``into`` (a writable buffer of ``block_bytes``) and verify
        it. CORRUPTED drops it from the index (it is never served); ``into`` then holds garbage."""
        out = memoryview(into).cast("B")
        if out.nbytes != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, the buffer {out.nbytes}")
        with self._lock:
            self._counts["reads"] += 1
            record = self._index.get(block_id)
            if record is None:
                self._counts["misses"] += 1
                return Outcome.MISS
            try:
                with open(self._file(record.segment), "rb") as f:
                    read = os.preadv(f.fileno(), [out], record.offset)
            except OSError as exc:
                log.warning("kv.disk.read_failed", block=f"{block_id:032x}", error=str(exc))
                read = -1
            if read != record.nbytes or xxhash.xxh3_64_intdigest(out) != record.digest:
                self._forget(block_id)
                self._counts["corrupted"] += 1
                log.warning("kv.disk.corrupted", block=f"{block_id:032x}", segment=record.segment)
                return Outcome.CORRUPTED
            self._segment_used[record.segment] = self._next_tick()
            self._counts["hits"] += 1
            return Outcome.HIT

    def drop(self, block_id: BlockId) -> bool:
        """Forget a block (its bytes go with its segment)."""
        with self._lock:
            return self._forget(block_id)

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
                             evicted_blocks=c["evicted_blocks"], disabled=self.disabled)

    def close(self) -> None:
        """Sync and close the segment being written (idempotent)."""
        with self._lock:
            self._close_head()
            self._head = None
