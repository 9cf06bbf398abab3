"""TCP transport: KV chunks over one stream per peer, with no copy in Python on either end.

Wire format. On connect the sender sends ``HELLO`` (magic ``b"PDKV"``, wire version, pdflow
protocol version) and the receiver answers with its own; a mismatch ends the connection with
:class:`~pdflow.transports.base.IncompatiblePeer`. Then each chunk is one frame: ``FRAME``
(magic, wire version, header length), the msgpack :class:`~pdflow.messages.KvChunkHeader`, and
the payload. Nothing else flows back from the receiver.

Copies. The payload is handed to the kernel from the caller's own memory (one ``sendmsg`` of
[framed header, payload], then ``sock_sendall`` of what is left), and received with
``recv_into`` straight into the registered region at the offset. Payloads with nowhere to go
(unknown region, out of bounds) are drained into a small scratch buffer.

Runs on asyncio and on uvloop. Options: ``timeout_s`` (connect + handshake, and how long sent
data may stay unacknowledged before the connection counts as dead; default 30) and
``buffer_bytes`` (SO_SNDBUF/SO_RCVBUF; default 0 keeps the kernel's autotuning, which matched
or beat a fixed 4 MiB on loopback; a fixed size is capped by ``net.core.[rw]mem_max``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog

from pdflow.messages import PROTOCOL_VERSION, KvChunkHeader
from pdflow.transports.base import (
    ChunkNotice,
    IncompatiblePeer,
    PeerDisconnected,
    PeerUnreachable,
    Transport,
    TransportClosed,
    TransportError,
    byte_view,
)

log = structlog.get_logger()

MAGIC = b"PDKV"
WIRE_VERSION = 1
HELLO = struct.Struct("!4sHH")  # magic, wire version, pdflow protocol version
FRAME = struct.Struct("!4sHI")  # magic, wire version, header length; then header, payload
_MAX_HEADER = 1 << 16
_SCRATCH = 1 << 16
_OPTIONS = {"timeout_s": 30.0, "buffer_bytes": 0}


def split_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError for anything else."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"not a tcp address: {address!r} (expected tcp://host:port)")
    return parts.hostname, parts.port


async def _recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; fewer bytes than asked only when the peer closed."""
    loop, got, want = asyncio.get_running_loop(), 0, view.nbytes
    while got < want:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            break
        got += n
    return got


async def _resolve(host: str, port: int) -> tuple[int, Any]:
    try:  # numeric addresses need no resolver thread
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        return family, (host, port)
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]


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
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"unknown tcp transport options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        super().__init__(host, port, **options)
        self.timeout_s = float(options.get("timeout_s", _OPTIONS["timeout_s"]))
        self.buffer_bytes = int(options.get("buffer_bytes", _OPTIONS["buffer_bytes"]))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvChunkHeader)
        self._hello = HELLO.pack(MAGIC, WIRE_VERSION, PROTOCOL_VERSION)
        self._links: dict[str, _Link] = {}
        self._listener: socket.socket | None = None
        self._address: str | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()

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
            split_address(address)  # ValueError before anything is kept for it
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
                await self._send(link.sock, head, payload)  # type: ignore[arg-type]
            except BaseException as exc:
                link.close()
                if self._closed and isinstance(exc, (OSError, TransportError)):
                    raise TransportClosed(f"tcp transport closed while writing to {address}") from exc
                if isinstance(exc, OSError):
                    log.warning("kv.conn.lost", peer=address, error=str(exc))
                    raise PeerDisconnected(f"lost connection to {address}: {exc}") from exc
                raise
            finally:
                if self._closed:
                    link.close()

    async def _connect(self, address: str, link: _Link) -> None:
        """Connect and handshake (within ``timeout_s``); sets ``link.sock``."""
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        link.attempts += 1
        link.failure = None
        try:
            async with asyncio.timeout(self.timeout_s):
                family, sockaddr = await _resolve(host, port)
                link.sock = sock = socket.socket(family, socket.SOCK_STREAM)
                self._tune(sock)
                if hasattr(socket, "TCP_USER_TIMEOUT"):  # a peer that stops acking: fail, don't hang
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.timeout_s * 1000))
                await loop.sock_connect(sock, sockaddr)
                await loop.sock_sendall(sock, self._hello)
                reply = bytearray(HELLO.size)
                got = await _recv_exact(sock, memoryview(reply))
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or f"no answer within {self.timeout_s} s"
            raise link.fail(PeerUnreachable(f"cannot connect to {address}: {reason}")) from exc
        if got < HELLO.size:
            raise link.fail(PeerUnreachable(f"{address} closed the connection during the handshake"))
        magic, wire, protocol = HELLO.unpack(reply)
        if magic != MAGIC or (wire, protocol) != (WIRE_VERSION, PROTOCOL_VERSION):
            raise link.fail(IncompatiblePeer(
                f"{address} is not a pdflow kv endpoint of this version (magic {magic!r}, wire "
                f"{wire}, protocol {protocol}; ours: wire {WIRE_VERSION}, protocol {PROTOCOL_VERSION})"
            ))  # fmt: skip
        log.debug("kv.conn.open", peer=address)

    @staticmethod
    async def _send(sock: socket.socket, head: bytes, payload: memoryview) -> None:
        """Framed header + payload, gathered by the kernel from both buffers (no joining)."""
        try:
            sent = sock.sendmsg([head, payload])
        except BlockingIOError:
            sent = 0
        loop = asyncio.get_running_loop()
        if sent < len(head):
            await loop.sock_sendall(sock, memoryview(head)[sent:])
            sent = len(head)
        if sent - len(head) < payload.nbytes:
            await loop.sock_sendall(sock, payload[sent - len(head) :])

    # --- receiving -------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_open()
        if self._listener is not None:
            return
        info = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock, sockaddr = socket.socket(info[0], info[1], info[2]), info[4]
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.buffer_bytes:  # accepted sockets inherit it, before the window is agreed
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes)
            sock.bind(sockaddr)
            sock.listen(256)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        host, port = sock.getsockname()[:2]
        self._address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        log.info("kv.listen", address=self.address)

    @property
    def address(self) -> str:
        if self._address is None:
            raise TransportError("tcp transport not started: call start() first")
        return self._address

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self._listener)  # type: ignore[arg-type]
            except OSError as exc:  # e.g. out of file descriptors: retry soon
                log.warning("kv.accept.failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            self._tune(conn)
            task = loop.create_task(self._serve(conn, f"{peer[0]}:{peer[1]}"))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        """One accepted connection: handshake, then frames until the sender closes."""
        header: KvChunkHeader | None = None
        try:
            if not await self._handshake(conn, peer):
                return
            prefix = bytearray(FRAME.size)
            while True:
                header = None
                got = await _recv_exact(conn, memoryview(prefix))
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
                if await _recv_exact(conn, memoryview(encoded)) < length:
                    raise PeerDisconnected(f"{peer} closed mid-header")
                try:
                    header = self._decoder.decode(encoded)
                except msgspec.DecodeError as exc:
                    log.error("kv.frame.malformed", peer=peer, error=str(exc))
                    return
                await self._receive_payload(conn, peer, header)
        except (OSError, PeerDisconnected) as exc:
            log.warning("kv.conn.lost", peer=peer, error=str(exc), mid_chunk=header is not None)
            if header is not None:
                error = PeerDisconnected(f"{peer} disconnected mid-payload: {exc}")
                self._post(ChunkNotice(header, error, time.monotonic()))
        finally:
            conn.close()

    async def _handshake(self, conn: socket.socket, peer: str) -> bool:
        hello = bytearray(HELLO.size)
        if await _recv_exact(conn, memoryview(hello)) < HELLO.size:
            return False
        await asyncio.get_running_loop().sock_sendall(conn, self._hello)
        magic, wire, protocol = HELLO.unpack(hello)
        if magic != MAGIC or (wire, protocol) != (WIRE_VERSION, PROTOCOL_VERSION):
            log.error("kv.handshake.rejected", peer=peer, magic=bytes(magic), wire=wire, protocol=protocol)
            return False
        return True

    async def _receive_payload(self, conn: socket.socket, peer: str, header: KvChunkHeader) -> None:
        if header.nbytes < 0:
            raise PeerDisconnected(f"{peer} sent a header with nbytes {header.nbytes}")
        span = self._landing(header)
        if isinstance(span, TransportError):  # read it into scratch space, keep the connection
            scratch = memoryview(bytearray(min(_SCRATCH, header.nbytes)))
            for start in range(0, header.nbytes, _SCRATCH):
                part = scratch[: min(_SCRATCH, header.nbytes - start)]
                if await _recv_exact(conn, part) < part.nbytes:
                    raise PeerDisconnected(f"{peer} closed mid-payload")
            self._post(ChunkNotice(header, span, time.monotonic()))
        elif await _recv_exact(conn, span) < header.nbytes:
            raise PeerDisconnected(f"{peer} closed mid-payload")
        else:
            self._post(self._landed(header, span))

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        for link in self._links.values():
            link.shutdown()
            if not link.lock.locked():
                link.close()
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        log.debug("kv.closed", transport="tcp")
