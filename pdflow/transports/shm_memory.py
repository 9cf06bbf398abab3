"""Memory for the shm transport: anonymous segments a receiver owns, and a sender's mappings of them.

A :class:`Segment` is a sealed ``memfd`` (Linux): it has no name in ``/dev/shm`` or anywhere
else, so there is nothing to clean up after a crash: the kernel frees the memory once the last
descriptor and mapping of it are gone, whichever process held them and however it ended. The
seals forbid shrinking, so a sender's writes into its mapping can never fault (SIGBUS) whatever
the receiver does. Receivers hand the descriptor to senders over a Unix socket (SCM_RIGHTS).
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
from collections import OrderedDict
from typing import Any

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
POPULATE_MAX = 1 << 30  # larger segments are mapped lazily


class Segment:
    """``nbytes`` (> 0) of shared memory owned by a receiver: ``fd`` is what senders map, ``view``
    the receiver's own writable view. ``id`` tells this segment from a later one of the same region."""

    def __init__(self, nbytes: int, id: int, label: str) -> None:
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)  # pages come with the first write
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.id, self.view = fd, id, memoryview(self.map)

    def close(self) -> None:
        """Close the descriptor (no new sender can map it) and unmap it here unless views of it are
        still held (then it goes with the last of them). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.view.release()
            self.map.close()
        except BufferError:  # the caller still holds the view allocate() returned
            pass


def map_segment(fd: int) -> memoryview:
    """Map a segment a receiver sent (closes ``fd``); ValueError unless it is sealed against shrinking.

    Every page of a segment up to :data:`POPULATE_MAX` is faulted in now (allocated and zeroed if
    the receiver has not touched it), so the writes into it run at copy speed and the receiver's
    allocate() never waits for that work; that takes about as long as a copy of the segment, so
    call it in a worker thread. A larger segment (a KV store's arena, mostly empty) is mapped
    lazily: its pages come with the first write to each."""
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ValueError("the peer sent memory that is not sealed against shrinking")
        size = os.fstat(fd).st_size
        populate = _POPULATE if size <= POPULATE_MAX else 0
        return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate))
    finally:
        os.close(fd)


STREAM = "stream"  # a region in the receiver's private memory: chunks go through the socket


class Mappings:
    """A sender's view of one receiver's regions: region -> (segment id, mapped view) or
    :data:`STREAM`; the least recently used are dropped (unmapped) beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[int, Any] = OrderedDict()

    def get(self, region: int) -> Any:
        entry = self._entries.get(region)
        if entry is not None:
            self._entries.move_to_end(region)
        return entry

    def put(self, region: int, entry: Any) -> None:
        self._entries[region] = entry
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def drop(self, region: int) -> None:
        self._entries.pop(region, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


async def copy(dst: memoryview, src: memoryview, thread_bytes: int) -> None:
    """``dst[:] = src``: in this thread (holding the GIL and the loop) below ``thread_bytes``, else in
    a worker thread that releases both. Cancelling waits for a started copy to finish, so no byte
    is written after the caller has gone."""
    if src.nbytes < thread_bytes or thread_bytes <= 0:
        dst[:] = src
        return
    import numpy as np

    work = asyncio.get_running_loop().run_in_executor(
        None, np.copyto, np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    )
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise
