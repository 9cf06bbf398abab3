"""Memory as the data plane sees it: any buffer as bytes, and a receiver's numbered regions.

:func:`byte_view` is how payloads and regions are taken in (their own memory, never a copy).
:class:`Regions` is what a receiver registered: where a chunk's payload goes, and whether it
landed whole (the region still there, the checksum right).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from pdflow.transports.checksum import checksum
from pdflow.messages import KvChunkHeader
from pdflow.transports.errors import ChecksumMismatch, ChunkNotice, OutOfBounds, TransportError, UnknownRegion


def byte_view(data: Any, *, writable: bool = False) -> memoryview:
    """A flat ``uint8`` memoryview of ``data``'s own memory (never a copy).

    Accepts anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays) and
    CPU torch tensors of any dtype. Raises ValueError for non-contiguous data, tensors on another
    device, or read-only data when ``writable``. The view keeps ``data`` alive.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"tensor on {data.device}: a transport that moves host memory only needs it "
                             "there first (pdflow.transports.staging)")
        if not data.is_contiguous():
            raise ValueError("tensor is not contiguous: call .contiguous() first (that copies)")
        data = data.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(data)
    except TypeError:
        raise ValueError(f"{type(data).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if writable and view.readonly:
        raise ValueError("buffer is read-only; a region must be writable")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise ValueError(f"cannot view buffer as bytes: {exc}") from None
    return view


class Regions(dict[int, memoryview]):
    """A receiver's regions by id: writable byte views of the buffers registered."""

    def add(self, region: int, buffer: Any) -> memoryview:
        """Register ``buffer`` as ``region``; ValueError if the id is taken or the buffer unsuitable."""
        view = byte_view(buffer, writable=True)
        if region in self:
            raise ValueError(f"region {region} is already registered")
        self[region] = view
        return view

    def landing(self, header: KvChunkHeader) -> memoryview | TransportError:
        """The span of the region where ``header``'s payload goes, or why there is none."""
        region = self.get(header.region)
        if region is None:
            return UnknownRegion(f"region {header.region} is not registered")
        if header.offset < 0 or header.offset + header.nbytes > region.nbytes:
            return OutOfBounds(
                f"chunk [{header.offset}, {header.offset + header.nbytes}) is beyond region "
                f"{header.region} of {region.nbytes} bytes"
            )
        return region[header.offset : header.offset + header.nbytes]

    def landed(self, header: KvChunkHeader, span: memoryview, digest: int | None = None) -> ChunkNotice:
        """The notice for a payload now in ``span``: checks the region is still there and the
        checksum (``digest``: the payload's, hashed as it landed; else ``span`` is hashed now)."""
        now = time.monotonic()
        region = self.get(header.region)
        if region is None or span.obj is not region.obj:
            error: TransportError = UnknownRegion(f"region {header.region} was unregistered while landing")
            return ChunkNotice(header, error, now)
        if (checksum(span) if digest is None else digest) != header.checksum:
            where = f"region {header.region} at {header.offset}, {header.nbytes} bytes"
            return ChunkNotice(header, ChecksumMismatch(f"checksum mismatch: {where}"), now)
        return ChunkNotice(header, None, now)
