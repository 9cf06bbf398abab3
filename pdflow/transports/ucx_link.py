"""One ucx link, both ends: the wire constants, the liveness connection, the receiving side.

:mod:`pdflow.transports.ucx` (whose docstring describes the protocol) makes them. :class:`Conn`
is one link's silent TCP connection (each side's liveness check) plus, on the sender, its UCX
endpoint: the sender's :class:`~pdflow.transports.links.Link`. :class:`Inbound` takes one link's
chunks in on the receiver, handing each to the transport through the two callbacks it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import xxhash

from pdflow.messages import KvChunkHeader
from pdflow.transports.errors import PeerDisconnected, TransportError
from pdflow.transports.links import Link
from pdflow.transports.sockets import Greeting, recv_exact
from pdflow.transports.ucx_worker import UCXError, UCXMessageTruncatedError, UcxWorker

log = structlog.get_logger()

MAGIC = b"PDUX"
WIRE_VERSION = 1
GREETING = Greeting(MAGIC, WIRE_VERSION, "ucx")
WELCOME = struct.Struct("!QH")  # link id, worker address length; then the worker address
FRAME = struct.Struct("!4sHI")  # magic, wire version, header length; then the msgpack header
MAX_HEADER = 1 << 16
SCRATCH = 1 << 16  # where payloads with nowhere to go are drained
PIECE = 16 << 20  # payloads go as messages of at most this size, each hashed as it lands (in L3)
_DECODER = msgspec.msgpack.Decoder(KvChunkHeader)

Landing = Callable[[KvChunkHeader], memoryview | TransportError]  # where a payload goes, or why not
Arrived = Callable[[KvChunkHeader, memoryview | TransportError, int | None], None]  # span or error, digest


def tune(sock: socket.socket, timeout_s: float) -> None:
    """Non-blocking, and keepalive so that a peer whose host vanished is noticed in ~timeout_s."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        every = max(1, int(timeout_s / 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


async def read_welcome(sock: socket.socket) -> tuple[int, bytes]:
    """The sender's side of WELCOME: (link id, the receiver's UCX worker address)."""
    welcome = bytearray(WELCOME.size)
    if await recv_exact(sock, memoryview(welcome)) < WELCOME.size:
        raise ConnectionError("closed during the handshake")
    link_id, length = WELCOME.unpack(welcome)
    worker_address = bytearray(length)
    if await recv_exact(sock, memoryview(worker_address)) < length:
        raise ConnectionError("closed during the handshake")
    return link_id, bytes(worker_address)


class Conn(Link):
    """One link to ``peer``: its silent TCP connection (the liveness check) and, on the sender,
    its endpoint on ``worker``."""

    def __init__(self, sock: socket.socket, peer: str, tag: int, worker: UcxWorker, endpoint: Any = None) -> None:
        self.sock, self.peer, self.tag, self.worker, self.endpoint = sock, peer, tag, worker, endpoint
        self.gone = False
        self.on_lost: Callable[[], None] | None = None
        self._waiting: set[asyncio.Future[None]] = set()
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            self.sock.recv(1)  # b"": the peer closed; a byte: not a pdflow peer. Either way: done
        except BlockingIOError:
            return
        except OSError:
            pass
        self.lost()

    def usable(self) -> bool:
        """False once the peer closed or reset (checked now, not only when the loop noticed)."""
        if not self.gone:
            try:
                self.sock.recv(1, socket.MSG_PEEK)
                self.lost()
            except BlockingIOError:
                pass
            except OSError:
                self.lost()
        return not self.gone

    def lost(self) -> None:
        """Mark the link gone and wake everything waiting on it (idempotent)."""
        if self.gone:
            return
        self.gone = True
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        for future in self._waiting:
            if not future.done():
                future.set_result(None)
        if self.on_lost is not None:
            self.on_lost()

    def interrupt(self) -> None:
        """Mark it gone, which wakes the writes waiting on it; the socket stays open for now."""
        self.lost()

    async def finish(self, request: Any) -> bool:
        """Wait for ``request``: True once it completed (UCXError if it failed), False if the
        link went first and nothing that had arrived completes it (the request is then dropped,
        which cancels it)."""
        worker = self.worker
        if not request.completed and not self.gone:
            future = worker.completion(request)
            self._waiting.add(future)
            try:
                await future
            finally:
                self._waiting.discard(future)
        if not request.completed:
            worker.progress()  # the peer went: take in what it had sent before
        if not request.completed:
            worker.forget(request)
            return False
        request.check_error()
        return True

    def close(self) -> None:
        """Close it now; the endpoint's UCX close goes on in the background (without error
        handling it never completes for a stopped or dead peer, and close_blocking would hang)."""
        self.lost()
        if self.endpoint is not None:
            self.worker.close_endpoint(self.endpoint)
        self.endpoint = None
        self.sock.close()


class Inbound:
    """One link's chunks on the receiver, taken in by callbacks that run inside UCX progress.

    Header received -> the payload's pieces received into the region one after another, each
    hashed as it lands (still in cache) -> checksum compared, notice -> the next header's
    receive posted: no task switch in between, while the sender waits on each step. ``ended``
    resolves when the link is over (the peer went, or sent something malformed). ``landing``
    says where a chunk's payload goes (or why nowhere); ``arrived`` gets each chunk's span (or
    why it did not land) and the payload's digest.
    """

    def __init__(self, conn: Conn, landing: Landing, arrived: Arrived) -> None:
        self.conn, self.peer, self.worker = conn, conn.peer, conn.worker
        self.landing, self.arrived = landing, arrived
        self.scratch = bytearray(SCRATCH)
        self.frame = bytearray(FRAME.size + MAX_HEADER)
        self.posted: deque[tuple[Any, memoryview | bytearray]] = deque()  # receives, in order
        self.header: KvChunkHeader | None = None  # while its payload is being received
        self.span: memoryview | TransportError | None = None
        self.hasher: Any = None
        self.received = 0  # bytes of the payload whose receive was posted
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.on_lost = self._lost
        self._expect_header()

    def _post(self, buffer: memoryview | bytearray, tag: int, callback: Callable[[Any], None]) -> None:
        request = self.worker.recv(buffer, tag)
        self.posted.append((request, buffer))
        self.worker.when_done(request, callback)

    def _expect_header(self) -> None:
        self.header = self.span = self.hasher = None
        self._post(self.frame, self.conn.tag, self._on_header)

    def _on_header(self, request: Any) -> None:
        self.posted.clear()
        try:
            request.check_error()
        except UCXError as exc:  # truncated: a header over the limit
            log.error("kv.frame.malformed", peer=self.peer, error=str(exc))
            return self.stop()
        magic, wire, length = FRAME.unpack_from(self.frame)
        if magic != MAGIC or wire != WIRE_VERSION or length > MAX_HEADER:
            log.error("kv.frame.malformed", peer=self.peer, magic=bytes(magic), wire=wire, length=length)
            return self.stop()
        try:
            header = _DECODER.decode(memoryview(self.frame)[FRAME.size : FRAME.size + length])
        except msgspec.DecodeError as exc:
            log.error("kv.frame.malformed", peer=self.peer, error=str(exc))
            return self.stop()
        if header.nbytes < 0:
            log.error("kv.frame.malformed", peer=self.peer, nbytes=header.nbytes)
            return self.stop()
        self.header, self.span, self.received = header, self.landing(header), 0
        if not isinstance(self.span, TransportError):
            self.hasher = xxhash.xxh3_64()  # = pdflow.transports.checksum.checksum, fed piece by piece
        self._next_piece()

    def _next_piece(self) -> None:
        """Post the next piece's receive (one at a time, so each is hashed while in cache)."""
        assert self.header is not None
        if self.received == self.header.nbytes:
            return self._landed()
        if isinstance(self.span, TransportError):  # nowhere to go: into scratch (UCX truncates it)
            piece: memoryview | bytearray = self.scratch
        else:
            piece = self.span[self.received : self.received + PIECE]
        self.received = min(self.received + PIECE, self.header.nbytes)
        self._post(piece, self.conn.tag | 1, self._on_piece)

    def _on_piece(self, request: Any) -> None:
        _, piece = self.posted.popleft()
        try:
            request.check_error()
        except UCXMessageTruncatedError:  # expected into scratch; into a span: a rogue peer
            if self.hasher is not None:
                return self._cut("sent more than its header said")
        except UCXError as exc:  # e.g. the CMA read failed: the sender died
            return self._cut(str(exc))
        if self.hasher is not None:
            self.hasher.update(piece)
        self._next_piece()

    def _landed(self) -> None:
        assert self.header is not None and self.span is not None
        self.arrived(self.header, self.span, None if self.hasher is None else self.hasher.intdigest())
        self._expect_header()

    def _cut(self, why: str) -> None:
        """The payload will not land: a PeerDisconnected notice for it, and the link ends."""
        assert self.header is not None
        log.warning("kv.conn.lost", peer=self.peer, error=why, mid_chunk=True)
        self.arrived(self.header, PeerDisconnected(f"{self.peer} disconnected mid-payload: {why}"), None)
        self.stop()

    def _lost(self) -> None:
        """The sender went: take in what it had sent before; a payload still missing is cut."""
        if self.posted:
            self.worker.progress()  # runs the callbacks of whatever had arrived
        if self.posted and self.header is not None:
            self._cut("connection closed")
        self.stop()

    def stop(self) -> None:
        """End the link: drop the posted receives (which cancels them). Idempotent."""
        for request, _ in self.posted:
            self.worker.forget(request)
        self.posted.clear()
        self.header = self.span = self.hasher = None
        if not self.ended.done():
            self.ended.set_result(None)
