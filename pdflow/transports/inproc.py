"""In-process transport: the reference implementation, for tests and single-process setups.

Receivers sit in a process-wide table by address (``inproc://<host>:<n>``). A write is one
memmove from the sender's buffer into the receiver's region, done in the sender's thread; the
checksum is verified there too, and the notice is posted on the receiver's event loop (through
``call_soon_threadsafe`` when that loop runs in another thread).
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from typing import Any

import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport
from pdflow.transports.errors import ChunkNotice, PeerDisconnected, PeerUnreachable, TransportError

log = structlog.get_logger()

_RECEIVERS: dict[str, InProcTransport] = {}
_LOCK = threading.Lock()


class InProcTransport(Transport):
    """Peers in this process only; writes never block and never fail half-way.

    ``port=0`` picks the lowest free number for ``host``; a receiver started again with the
    same host and port gets the same address back (as a restarted tcp peer would).
    """

    name = "inproc"
    cross_process = False

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        if options:
            raise TypeError(f"inproc transport takes no options, got {sorted(options)}")
        super().__init__(host, port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sent_to: dict[str, int] = {}

    async def start(self) -> None:
        self._check_open()
        if self._address is not None:
            return
        with _LOCK:
            port = self.port or next(n for n in range(1, 1 << 31) if self._at(n) not in _RECEIVERS)
            address = self._at(port)
            if address in _RECEIVERS:
                raise OSError(errno.EADDRINUSE, f"{address} is in use")
            self._loop = asyncio.get_running_loop()
            self._address = address
            _RECEIVERS[address] = self
        log.debug("kv.listen", address=address)

    def _at(self, port: int) -> str:
        return f"inproc://{self.host}:{port}"

    def advertise(self, host: str) -> None:
        """Nothing to do: an inproc address names a receiver in this process, not a host."""

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        """As :meth:`Transport.write`, with no link: the receiver is in this process."""
        payload = self._payload(header, data)
        await asyncio.sleep(0)  # a checkpoint, as in every transport: writes interleave, close can cut in
        self._check_open()
        with _LOCK:
            receiver = _RECEIVERS.get(address)
        if receiver is None:
            raise PeerUnreachable(f"no inproc receiver at {address}")
        receiver._deliver(header, payload)
        self.sent_bytes += header.nbytes
        self._sent_to[address] = self._sent_to.get(address, 0) + header.nbytes

    def sent_by_peer(self) -> dict[str, int]:
        return dict(self._sent_to)

    def _deliver(self, header: KvChunkHeader, payload: memoryview) -> None:
        """Runs in the sender's thread: land the payload, then post the notice on our loop."""
        if self._closed or self._loop is None:
            raise PeerDisconnected(f"inproc receiver at {self._address} closed")
        span = self._regions.landing(header)
        if isinstance(span, TransportError):
            notice = ChunkNotice(header, span, time.monotonic())
        else:
            span[:] = payload  # the one copy
            notice = self._regions.landed(header, span)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._post(notice)
            return
        try:
            self._loop.call_soon_threadsafe(self._post, notice)
        except RuntimeError as exc:  # the receiver's loop is closed
            raise PeerDisconnected(f"inproc receiver at {self._address} is gone") from exc

    async def aclose(self) -> None:
        self._mark_closed()
        with _LOCK:
            if self._address is not None and _RECEIVERS.get(self._address) is self:
                del _RECEIVERS[self._address]
                log.debug("kv.closed", address=self._address)
