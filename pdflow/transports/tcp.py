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
import socket
import struct
from typing import Any

import msgspec
import structlog
import xxhash

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport
from pdflow.transports.errors import PeerDisconnected, TransportError
from pdflow.transports.sockets import (
    Acceptor,
    Greeting,
    SocketLink,
    address_of,
    dial,
    listen_inet,
    recv_exact,
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


class TcpTransport(Transport):
    """KV chunks over TCP; see the module docstring for the wire format and the options."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s, self.buffer_bytes = float(settings["timeout_s"]), int(settings["buffer_bytes"])
        self._acceptor: Acceptor | None = None

    def _tune(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes)

    # --- sending (the steps of Transport.write) ------------------------------------------------

    def _peer(self, address: str) -> str:
        split_address(address, "tcp")
        return address

    async def _connect(self, peer: str) -> SocketLink:
        def tune(sock: socket.socket) -> None:
            self._tune(sock)
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # a peer that stops acking: fail, don't hang
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.timeout_s * 1000))

        sock, _ = await dial(peer, GREETING, self.timeout_s, setup=tune, key=self.proof_key)
        log.debug("kv.conn.open", peer=peer)
        return SocketLink(sock)

    async def _send(self, link: SocketLink, address: str, header: KvChunkHeader, payload: memoryview) -> None:
        encoded = self._encoder.encode(header)
        head = FRAME.pack(MAGIC, WIRE_VERSION, len(encoded)) + encoded
        await send_gathered(link.sock, head, payload)  # type: ignore[arg-type]

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
            if not await GREETING.answer(conn, peer, self.proof_key, self.timeout_s):
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
                self._arrived(header, PeerDisconnected(f"{peer} disconnected mid-payload: {exc}"))
        finally:
            conn.close()

    async def _receive_payload(self, conn: socket.socket, peer: str, header: KvChunkHeader) -> None:
        if header.nbytes < 0:
            raise PeerDisconnected(f"{peer} sent a header with nbytes {header.nbytes}")
        span = self._regions.landing(header)
        if isinstance(span, TransportError):  # read it into scratch space, keep the connection
            scratch = memoryview(bytearray(min(_SCRATCH, header.nbytes)))
            for start in range(0, header.nbytes, _SCRATCH):
                part = scratch[: min(_SCRATCH, header.nbytes - start)]
                if await recv_exact(conn, part) < part.nbytes:
                    raise PeerDisconnected(f"{peer} closed mid-payload")
            self._arrived(header, span)
        else:
            hasher = xxhash.xxh3_64()  # = pdflow.transports.checksum.checksum, fed as the bytes land
            if await recv_exact(conn, span, hasher) < header.nbytes:
                raise PeerDisconnected(f"{peer} closed mid-payload")
            self._arrived(header, span, hasher.intdigest())

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._close_links()
        if self._acceptor is not None:
            await self._acceptor.aclose()
        log.debug("kv.closed", transport="tcp")
