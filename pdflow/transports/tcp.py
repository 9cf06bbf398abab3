"""TCP transport: KV chunks over one stream per peer, with no copy in Python on either end.

Wire format. On connect the sender sends ``HELLO`` (magic ``b"PDKV"``, wire version, pdflow
protocol version) and the receiver answers with its own; a mismatch ends the connection with
:class:`~pdflow.transports.base.IncompatiblePeer`. Then each chunk is one frame: ``FRAME``
(magic, wire version, header length), the msgpack :class:`~pdflow.messages.KvChunkHeader`, and
the payload. Nothing else flows back from the receiver.

Copies. The payload is handed to the kernel from the caller's own memory (one ``sendmsg`` of
[framed header, payload], then ``sock_sendall`` of what is left), and received with
``recv_into`` straight into the registered region at the offset, each piece hashed for the
checksum as it lands (still in cache). Reads are tried before waiting on the event loop, and the
receiver yields to the loop once per frame. Payloads with nowhere to go (unknown region, out of
bounds) are drained into a small scratch buffer.

Runs on asyncio and on uvloop. Options: ``timeout_s`` (connect + handshake, and how long sent
data may stay unacknowledged before the connection counts as dead; default 30) and
``buffer_bytes`` (SO_SNDBUF/SO_RCVBUF; default 0 keeps the kernel's autotuning, which matched
or beat a fixed 4 MiB on loopback; a fixed size is capped by ``net.core.[rw]mem_max``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

import msgspec
import structlog
import xxhash

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import (
    ChunkNotice,
    PeerDisconnected,
    PeerUnreachable,
    Transport,
    TransportError,
    byte_view,
)
from pdflow.transports.sockets import (
    Acceptor,
    Greeting,
    address_of,
    listen_inet,
    recv_exact,
    resolve,
    send_gathered,
    split_address,
)

log = structlog.get_logger()

MAGIC = b"PDKV"
WIRE_VERSION = 1
GREETING = Greeting(MAGIC, WIRE_VERSION, "tcp")
FRAME = struct.Struct("!4sHI")  # magic, wire version, header length; then header, payload
_MAX_HEADER = 1 << 16
_SCRATCH = 1 << 16
_OPTIONS = {"timeout_s": 30.0, "buffer_bytes": 0}


class _Link:
    """The one connection to one peer address; frames go out whole, under ``lock``."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.sock: socket.socket | None = None
        self.attempts = 0  # connects tried so far
        self.failure: PeerUnreachable | None = None  # why the last one failed

    def usable(self) -> bool:
        """False when the peer has closed or reset (a non-blocking peek: it never sends)."""
        if self.sock is None:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; any byte: not a pdflow receiver
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def fail(self, error: PeerUnreachable) -> PeerUnreachable:
        """Close, and remember why connecting failed (for the writes queued meanwhile)."""
        self.close()
        self.failure = error
        return error

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def shutdown(self) -> None:
        """Wake whatever waits on the socket (it fails with EPIPE); the lock holder closes it."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


class TcpTransport(Transport):
    """KV chunks over TCP; see the module docstring for the wire format and the options."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s, self.buffer_bytes = float(settings["timeout_s"]), int(settings["buffer_bytes"])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvChunkHeader)
        self._links: dict[str, _Link] = {}
        self._acceptor: Acceptor | None = None

    def _tune(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes)

    # --- sending ---------------------------------------------------------------------------

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        self._check_open()
        payload = byte_view(data)
        if payload.nbytes != header.nbytes:
            raise ValueError(f"data has {payload.nbytes} bytes, header.nbytes is {header.nbytes}")
        encoded = self._encoder.encode(header)
        head = FRAME.pack(MAGIC, WIRE_VERSION, len(encoded)) + encoded
        link = self._links.get(address)
        if link is None:
            split_address(address, "tcp")  # ValueError before anything is kept for it
            link = self._links.setdefault(address, _Link())
        attempts = link.attempts
        async with link.lock:
            try:
                self._check_open()
                if not link.usable():
                    link.close()
                    if link.failure is not None and link.attempts > attempts:
                        # it failed while we queued: fail too rather than wait out a timeout each
                        raise type(link.failure)(*link.failure.args)
                    await self._connect(address, link)
                await send_gathered(link.sock, head, payload)  # type: ignore[arg-type]
            except BaseException as exc:
                link.close()
                if (error := self._write_error(exc, address)) is exc:
                    raise
                raise error from exc
            finally:
                if self._closed:
                    link.close()

    async def _connect(self, address: str, link: _Link) -> None:
        """Connect and handshake (within ``timeout_s``); sets ``link.sock``."""
        host, port = split_address(address, "tcp")
        loop = asyncio.get_running_loop()
        link.attempts += 1
        link.failure = None
        try:
            async with asyncio.timeout(self.timeout_s):
                family, sockaddr = await resolve(host, port)
                link.sock = sock = socket.socket(family, socket.SOCK_STREAM)
                self._tune(sock)
                if hasattr(socket, "TCP_USER_TIMEOUT"):  # a peer that stops acking: fail, don't hang
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.timeout_s * 1000))
                await loop.sock_connect(sock, sockaddr)
                await loop.sock_sendall(sock, GREETING.ours)
                refused = await GREETING.check(sock)
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or f"no answer within {self.timeout_s} s"
            raise link.fail(PeerUnreachable(f"cannot connect to {address}: {reason}")) from exc
        if refused is not None:
            raise link.fail(type(refused)(f"{address} {refused}"))
        log.debug("kv.conn.open", peer=address)

    # --- receiving -------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_open()
        if self._acceptor is not None:
            return
        listener = listen_inet(self.host, self.port, self.buffer_bytes)
        self._address = address_of("tcp", listener)
        self._acceptor = Acceptor(listener, self._serve)
        log.info("kv.listen", address=self.address)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        """One accepted connection: handshake, then frames until the sender closes."""
        self._tune(conn)
        header: KvChunkHeader | None = None
        try:
            if not await GREETING.answer(conn, peer):
                return
            prefix = bytearray(FRAME.size)
            while True:
                header = None
                got = await recv_exact(conn, memoryview(prefix))
                if got == 0:
                    log.debug("kv.conn.closed", peer=peer)
                    return
                if got < FRAME.size:
                    raise PeerDisconnected(f"{peer} closed mid-frame")
                magic, wire, length = FRAME.unpack(prefix)
                if magic != MAGIC or wire != WIRE_VERSION or length > _MAX_HEADER:
                    log.error("kv.frame.malformed", peer=peer, magic=bytes(magic), wire=wire, length=length)
                    return
                encoded = bytearray(length)
                if await recv_exact(conn, memoryview(encoded)) < length:
                    raise PeerDisconnected(f"{peer} closed mid-header")
                try:
                    header = self._decoder.decode(encoded)
                except msgspec.DecodeError as exc:
                    log.error("kv.frame.malformed", peer=peer, error=str(exc))
                    return
                await self._receive_payload(conn, peer, header)
                await asyncio.sleep(0)  # reads go eagerly: let other tasks run between frames
        except (OSError, PeerDisconnected) as exc:
            log.warning("kv.conn.lost", peer=peer, error=str(exc), mid_chunk=header is not None)
            if header is not None:
                error = PeerDisconnected(f"{peer} disconnected mid-payload: {exc}")
                self._post(ChunkNotice(header, error, time.monotonic()))
        finally:
            conn.close()

    async def _receive_payload(self, conn: socket.socket, peer: str, header: KvChunkHeader) -> None:
        if header.nbytes < 0:
            raise PeerDisconnected(f"{peer} sent a header with nbytes {header.nbytes}")
        span = self._landing(header)
        if isinstance(span, TransportError):  # read it into scratch space, keep the connection
            scratch = memoryview(bytearray(min(_SCRATCH, header.nbytes)))
            for start in range(0, header.nbytes, _SCRATCH):
                part = scratch[: min(_SCRATCH, header.nbytes - start)]
                if await recv_exact(conn, part) < part.nbytes:
                    raise PeerDisconnected(f"{peer} closed mid-payload")
            self._post(ChunkNotice(header, span, time.monotonic()))
        else:
            hasher = xxhash.xxh3_64()  # = pdflow.kv.checksum.checksum, fed as the bytes land
            if await recv_exact(conn, span, hasher) < header.nbytes:
                raise PeerDisconnected(f"{peer} closed mid-payload")
            self._post(self._landed(header, span, hasher.intdigest()))

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        for link in self._links.values():
            link.shutdown()
            if not link.lock.locked():
                link.close()
        if self._acceptor is not None:
            await self._acceptor.aclose()
        log.debug("kv.closed", transport="tcp")
