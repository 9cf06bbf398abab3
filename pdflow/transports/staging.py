"""Staging: device bytes through host buffers, for links with no direct path to device memory.

Where a stage's KV is in device memory (a model on ``cuda``) and its transport sends from or
lands in host memory only (:meth:`~pdflow.transports.Transport.memory_kinds`), the bytes pass
through host buffers. :class:`StagingPool` bounds how many bytes of them there are (pinned
memory where CUDA is, so that copies are asynchronous DMA); a stage that wants more waits for
a buffer to come back instead of growing without bound. :class:`Stager` makes the copies on a
worker thread, on a CUDA stream of its own that first waits for the producer's event: the event
loop never blocks on a copy and the compute stream never waits for one.

:func:`data_path` says, for a stage's memory and a transport, whether the bytes go directly or
are staged; ``pdflow validate`` prints it for every link.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdflow.transports.memory import HOST, MemoryKinds, kind_of, memory_of

DEFAULT_CAPACITY = 64 << 20  # bytes of host buffers a stage may hold for staging at once
_MIN_BUFFER = 64 << 10


@dataclass(frozen=True)
class DataPath:
    """How a stage's bytes meet a transport: ``direct`` (the transport moves them from where
    they are, or lands them where the stage reads them) or staged through host buffers."""

    direct: bool
    description: str


def data_path(memory: str, kinds: MemoryKinds, direction: str, transport: str = "the transport") -> DataPath:
    """For a stage whose KV is in ``memory`` (``"host"``, ``"cuda:0"``), sending
    (``direction="send"``) or receiving (``"receive"``) over a transport that moves ``kinds``."""
    if direction not in ("send", "receive"):
        raise ValueError(f"direction must be 'send' or 'receive', got {direction!r}")
    kind = kind_of(memory)
    usable = kinds.reads if direction == "send" else kinds.lands
    if kind in usable:
        where = "from" if direction == "send" else "into"
        return DataPath(True, f"direct: {transport} {direction}s {where} {memory} memory")
    if direction == "send":
        return DataPath(False, f"staged: copied to host through a bounded pool of pinned buffers (on a CUDA "
                               f"stream and a thread of their own), then sent by {transport}")
    return DataPath(False, f"staged: landed in host memory by {transport}, then copied to {memory} off "
                           "the event loop")


class StagingPool:
    """Host buffers for staging, at most ``capacity_bytes`` of them in use or kept at once.

    ``pinned``: page-locked memory (default: where CUDA is available). A lease gets the first
    bytes of a buffer whose size is the next power of two (from 64 KiB, at most the capacity), so
    that layers of prompts of any length reuse the same few buffers: they come back to the pool
    when their lease ends. A request larger than the capacity is a ValueError (it could never be
    served); others wait until enough is free, and one that fits beside those held is served at
    once, even while a larger one waits. A size's first buffer is allocated on the caller's thread
    (pinning is a system call: once per size, then reused).
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY, pinned: bool | None = None) -> None:
        import torch

        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.in_use_bytes = 0  # of the buffers leased (their whole size)
        self.peak_bytes = 0
        self.waits = 0  # leases that had to wait for a buffer to come back
        self._free: dict[int, list[Any]] = {}  # kept buffers by size
        self._kept_bytes = 0
        self._returned: asyncio.Event | None = None

    def size_for(self, nbytes: int) -> int:
        """The size of the buffer a lease of ``nbytes`` takes."""
        return min(self.capacity_bytes, max(_MIN_BUFFER, 1 << max(nbytes - 1, 0).bit_length()))

    @contextlib.asynccontextmanager
    async def lease(self, nbytes: int) -> AsyncIterator[Any]:
        """A flat ``uint8`` host tensor of ``nbytes``, the caller's until the block ends."""
        import torch

        if nbytes > self.capacity_bytes:
            raise ValueError(f"{nbytes} bytes to stage at once, more than the pool's {self.capacity_bytes}")
        size = self.size_for(nbytes)
        if self.in_use_bytes + size > self.capacity_bytes:
            self.waits += 1
            if self._returned is None:
                self._returned = asyncio.Event()
            while self.in_use_bytes + size > self.capacity_bytes:
                self._returned.clear()
                await self._returned.wait()
        buffer = self._take(size, torch)
        self.in_use_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        try:
            yield buffer[:nbytes]
        finally:  # (no await here: a cancelled holder gives its buffer back all the same)
            self.in_use_bytes -= size
            self._free.setdefault(size, []).append(buffer)
            self._kept_bytes += size
            if self._returned is not None:
                self._returned.set()

    def _take(self, size: int, torch: Any) -> Any:
        kept = self._free.get(size)
        if kept:
            self._kept_bytes -= size
            return kept.pop()
        # Drop kept buffers of other sizes until the new one fits beside those in use.
        for other in sorted(self._free, reverse=True):
            while self._free[other] and self.in_use_bytes + self._kept_bytes + size > self.capacity_bytes:
                self._free[other].pop()
                self._kept_bytes -= other
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)


class Stager:
    """Copies between device and host memory off the event loop (see the module docstring).

    ``executor``: the worker thread(s) for the copies (default: one of its own). On a device
    with CUDA each copy runs on a stream of the stager's own, after the producer's event.
    """

    def __init__(self, pool: StagingPool | None = None, executor: concurrent.futures.Executor | None = None) -> None:
        self.pool = pool or StagingPool()
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdflow-stage")
        self._streams: dict[Any, Any] = {}
        self.copied_bytes = 0

    @contextlib.asynccontextmanager
    async def to_host(self, tensors: Sequence[Any], ready: Any = None) -> AsyncIterator[list[Any]]:
        """``tensors`` (contiguous) in host memory for the duration of the block: as they are when
        they are there already, else copied into one leased pool buffer (after ``ready``, the
        producer's CUDA event; by default after what the calling thread's stream has queued)."""
        import torch

        if all(memory_of(t) == HOST for t in tensors):
            yield list(tensors)
            return
        total = sum(t.numel() * t.element_size() for t in tensors)
        async with self.pool.lease(total) as buffer:
            views, at = [], 0
            for t in tensors:
                n = t.numel() * t.element_size()
                views.append(buffer[at : at + n].view(t.dtype).view(t.shape))
                at += n
            await self._copy(list(zip(views, tensors)), tensors[0].device, ready, torch)
            yield views

    async def to_device(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each ``(device tensor, host tensor)`` pair's host bytes into the device tensor."""
        import torch

        if pairs:
            await self._copy(list(pairs), pairs[0][0].device, None, torch)

    async def _copy(self, pairs: list[tuple[Any, Any]], device: Any, ready: Any, torch: Any) -> None:
        stream = None
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            if ready is None:  # after what is queued on the caller's stream (what made the bytes)
                ready = torch.cuda.current_stream(device).record_event()

        def copy() -> None:
            if stream is None:
                for dst, src in pairs:
                    dst.copy_(src)
                return
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    for t in (dst, src):
                        if t.device.type == "cuda":
                            t.record_stream(stream)  # not reused by its allocator before the copy is done
                done = stream.record_event()
            done.synchronize()

        await asyncio.get_running_loop().run_in_executor(self._executor, copy)
        self.copied_bytes += sum(src.numel() * src.element_size() for _, src in pairs)

    def close(self) -> None:
        self._executor.shutdown(wait=False)
