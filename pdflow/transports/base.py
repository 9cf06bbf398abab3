"""The KV data plane's one interface: one-sided writes into memory the receiver registered.

The model is the one RDMA, UCX, NIXL and Mooncake's transfer engine share. The receiver
registers buffers as numbered *regions* and hands out its :attr:`Transport.address`; a sender
writes a chunk (a :class:`~pdflow.messages.KvChunkHeader` plus its payload) into a peer's region
at an offset; once the bytes have fully landed and their checksum is verified, the receiver gets
a :class:`ChunkNotice` from :meth:`Transport.next_notice`. Every failure is a
:class:`TransportError` subclass, so callers never see a raw ``OSError`` and never hang.

A transport object belongs to the event loop that first uses it. Built-in implementations live
next to this module; :mod:`pdflow.transports` finds them by name.
"""

from __future__ import annotations

import asyncio
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog

from pdflow.kv.checksum import checksum
from pdflow.messages import KvChunkHeader

log = structlog.get_logger()


class TransportError(Exception):
    """Base of every error a transport raises or reports in a notice."""


class TransportClosed(TransportError):
    """The transport was closed with :meth:`Transport.aclose` (before or during the call)."""


class PeerUnreachable(TransportError):
    """Cannot connect to the address (nothing listens there, timeout, handshake refused)."""


class PeerDisconnected(TransportError):
    """The connection was lost mid-transfer (the other side died or closed)."""


class IncompatiblePeer(PeerUnreachable):
    """The peer speaks another wire protocol version: run the same pdflow on both sides."""


class ChecksumMismatch(TransportError):
    """The landed bytes do not hash to ``header.checksum``."""


class UnknownRegion(TransportError):
    """A chunk for a region that is not registered (or was unregistered while it landed)."""


class OutOfBounds(TransportError):
    """``offset + nbytes`` lies beyond the region (or the offset is negative)."""


@dataclass(frozen=True, slots=True)
class ChunkNotice:
    """One chunk that reached this receiver.

    ``error`` is None when the bytes are in the region and their checksum is verified; otherwise
    it says why they are not (the region's bytes in the chunk's span are then unspecified).
    ``received_at`` is the ``time.monotonic()`` of the moment it landed.
    """

    header: KvChunkHeader
    error: TransportError | None = None
    received_at: float = 0.0


def byte_view(data: Any, *, writable: bool = False) -> memoryview:
    """A flat ``uint8`` memoryview of ``data``'s own memory (never a copy).

    Accepts anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays) and
    CPU torch tensors of any dtype. Raises ValueError for non-contiguous data, tensors on another
    device, or read-only data when ``writable``. The view keeps ``data`` alive.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"tensor on {data.device}: copy it to host memory first")
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


_CLOSED = object()


class Transport(ABC):
    """One endpoint of the KV data plane; sends, receives, or both.

    Life cycle: create it, :meth:`register` regions and :meth:`start` it (receivers), pass its
    :attr:`address` to senders through the control plane, :meth:`write` to peers, read
    :meth:`next_notice`, and :meth:`aclose` it (also ``async with transport:``).

    Regions: :meth:`register` keeps a reference to the buffer, so its memory stays valid until
    :meth:`unregister` drops it. The caller must not resize it (a bytearray with an exported
    view cannot be resized) and must not read a chunk's span before its notice arrives.

    A transport belongs to the event loop that first uses it (one per process and loop).
    """

    name: ClassVar[str]
    cross_process: ClassVar[bool] = True  # False: peers must live in this process (inproc)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.host = host
        self.port = port
        self.options = options
        self._regions: dict[int, memoryview] = {}
        self._notices: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._address: str | None = None  # set by start()

    def _settings(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """``self.options`` over ``defaults``; TypeError naming any option not in ``defaults``."""
        unknown = set(self.options) - set(defaults)
        if unknown:
            raise TypeError(f"unknown {self.name} transport options {sorted(unknown)}; known: {sorted(defaults)}")
        return {**defaults, **self.options}

    @abstractmethod
    async def start(self) -> None:
        """Start receiving (bind the listener). Idempotent; a sender-only transport may skip it.

        Raises OSError when the address is taken.
        """

    @property
    def address(self) -> str:
        """What a peer passes to :meth:`write`, e.g. ``tcp://127.0.0.1:5601``; valid after start()."""
        if self._address is None:
            raise TransportError(f"{self.name} transport not started: call start() first")
        return self._address

    def register(self, region: int, buffer: Any) -> None:
        """Make ``buffer`` (writable, contiguous: bytearray, memoryview, numpy array, CPU torch
        tensor) region ``region``. Chunks for it land there from now on.

        Raises ValueError if the id is taken or the buffer is unsuitable. Register before telling
        a sender about the region: a chunk that arrives first gets an UnknownRegion notice.
        """
        view = byte_view(buffer, writable=True)
        if region in self._regions:
            raise ValueError(f"region {region} is already registered")
        self._regions[region] = view

    def allocate(self, region: int, nbytes: int) -> memoryview:
        """Allocate ``nbytes`` of memory this transport can receive into, register it as
        ``region`` and return a writable view of it (valid until :meth:`unregister`).

        This is how stages get receive buffers: a transport whose peers write into shared or
        pinned memory (shm, RDMA) allocates it there, so KV lands where the stage reads it.
        The default is plain process memory.
        """
        buffer = memoryview(bytearray(nbytes))
        self.register(region, buffer)
        return buffer

    def address_for(self, region: int) -> str:
        """The address a sender passes to :meth:`write` for ``region`` (what NIXL calls the
        remote metadata). Most transports need only :attr:`address`; one whose senders map the
        receiver's memory directly may add where the region lives."""
        return self.address

    def unregister(self, region: int) -> None:
        """Forget a region (idempotent) and release its memory if :meth:`allocate` made it;
        chunks for it later get an UnknownRegion notice.

        A chunk already landing may still write into the old buffer; its notice then carries
        UnknownRegion. Keep the buffer until such notices are in if that matters.
        """
        self._regions.pop(region, None)

    @abstractmethod
    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        """Write ``data`` into region ``header.region`` at ``header.offset`` of the peer at ``address``.

        ``data`` is any C-contiguous buffer or CPU torch tensor (sent from its own memory, no
        copy; ValueError if non-contiguous) of exactly ``header.nbytes`` bytes (ValueError
        otherwise). ``header.checksum`` is the caller's (:func:`pdflow.kv.checksum.checksum`);
        the receiver verifies it. Returns once the bytes have left ``data`` (it may be reused);
        landing is reported to the receiver only. Many writes may be in flight at once, to one
        or several peers; those to one address go out in call order.

        Raises PeerUnreachable (cannot connect), PeerDisconnected (connection lost; the next
        write reconnects by itself, e.g. after the peer restarted at the same address) or
        TransportClosed. Cancelling a write mid-payload drops the connection (the receiver gets
        a PeerDisconnected notice for that chunk).
        """

    async def next_notice(self) -> ChunkNotice:
        """The next chunk that landed here (or failed to). Raises TransportClosed after aclose(),
        including in calls already waiting."""
        if self._closed:
            raise TransportClosed(f"{self.name} transport is closed")
        item = await self._notices.get()
        if item is _CLOSED:
            self._notices.put_nowait(_CLOSED)  # wake the next waiter too
            raise TransportClosed(f"{self.name} transport is closed")
        return item

    @abstractmethod
    async def aclose(self) -> None:
        """Close listener and connections. Always closes, idempotent. Pending and later
        next_notice() and write() calls raise TransportClosed (a write may also complete)."""

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- helpers for implementations -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name} transport is closed")

    def _mark_closed(self) -> None:
        """Set the closed flag and wake every next_notice() waiter."""
        if not self._closed:
            self._closed = True
            self._notices.put_nowait(_CLOSED)

    def _write_error(self, exc: BaseException, address: str) -> BaseException:
        """What a write that failed with ``exc`` raises: TransportClosed when the transport was
        closed meanwhile, PeerDisconnected for a socket error (logged), else ``exc`` itself."""
        if self._closed and isinstance(exc, (OSError, TransportError)):
            return TransportClosed(f"{self.name} transport closed while writing to {address}")
        if isinstance(exc, OSError):
            log.warning("kv.conn.lost", transport=self.name, peer=address, error=str(exc))
            return PeerDisconnected(f"lost connection to {address}: {exc}")
        return exc

    def _post(self, notice: ChunkNotice) -> None:
        if not self._closed:
            self._notices.put_nowait(notice)

    def _landing(self, header: KvChunkHeader) -> memoryview | TransportError:
        """The span of the region where ``header``'s payload goes, or why there is none."""
        region = self._regions.get(header.region)
        if region is None:
            return UnknownRegion(f"region {header.region} is not registered")
        if header.offset < 0 or header.offset + header.nbytes > region.nbytes:
            return OutOfBounds(
                f"chunk [{header.offset}, {header.offset + header.nbytes}) is beyond region "
                f"{header.region} of {region.nbytes} bytes"
            )
        return region[header.offset : header.offset + header.nbytes]

    def _landed(self, header: KvChunkHeader, span: memoryview, digest: int | None = None) -> ChunkNotice:
        """The notice for a payload now in ``span``: checks the region is still there and the
        checksum (``digest``: the payload's, hashed as it landed; else ``span`` is hashed now)."""
        now = time.monotonic()
        region = self._regions.get(header.region)
        if region is None or span.obj is not region.obj:
            error: TransportError = UnknownRegion(f"region {header.region} was unregistered while landing")
            return ChunkNotice(header, error, now)
        if (checksum(span) if digest is None else digest) != header.checksum:
            where = f"region {header.region} at {header.offset}, {header.nbytes} bytes"
            return ChunkNotice(header, ChecksumMismatch(f"checksum mismatch: {where}"), now)
        return ChunkNotice(header, None, now)
