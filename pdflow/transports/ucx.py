"""UCX transport: KV chunks as ucxx tagged messages, received straight into the registered region.

Connecting. A receiver listens on ``ucx://host:port``, a plain TCP socket. A sender connects
there once per address and both say HELLO (magic ``b"PDUX"``, wire version, pdflow protocol
version; a mismatch is :class:`~pdflow.transports.base.IncompatiblePeer`); the receiver adds
WELCOME: a link id and its UCX *worker address*. The sender makes its UCX endpoint from that
worker address with UCX error handling off: that is what lets UCX use shared memory and CMA
(the ucxx listener path, and error handling, restrict it to TCP). The worker addresses are thus
exchanged per link over this connection, not through the control plane: the receiver keeps one
stable address across restarts (a worker address is new with every worker), and the connection
stays open, silent, for the life of the link as each side's liveness check. The kernel closes
it the moment either process dies (TCP keepalive notices a vanished host in about
``timeout_s``), which UCX without error handling never reports: a write to a dead or killed
receiver would otherwise wait forever.

Chunks. Each is tagged messages on the link's endpoint, posted in call order (UCX keeps one
endpoint's messages in order): the header frame (``FRAME`` + msgpack
:class:`~pdflow.messages.KvChunkHeader`, eager, tag ``link << 1``), then the payload from the
caller's own memory (tag ``link << 1 | 1``, in messages of at most ``PIECE`` bytes; none when
empty; from 8 KiB on a rendezvous that the receiver completes with one CMA read). The receiver
(:class:`~pdflow.transports.ucx_link.Inbound`, callbacks run inside UCX progress) takes the
header, receives each piece straight into the region at its offset and hashes it while it is
still in cache, compares the checksum and posts the notice. A payload with nowhere to go is
drained into a small scratch buffer (UCX truncates it). ``write`` returns when UCX completes the
sends: the receiver has read the payload (rendezvous) or it sits in the receiver's
shared-memory FIFO (eager, < 8 KiB).

Failures. Connecting fails: PeerUnreachable. The link's TCP connection closes or a UCX request
fails: PeerDisconnected for the writes in flight; the next write reconnects. A receiver whose
sender went takes in what had already arrived, then posts a PeerDisconnected notice for a chunk
cut mid-payload. A peer that stops without closing (SIGSTOP) blocks writes, as tcp's do. UCX
cannot cancel a rendezvous send: a failed write's payload may still be read by a stopped peer
that resumes (if the caller changed it meanwhile, that chunk's notice fails its checksum).

Options: ``timeout_s`` (connect + handshake, and TCP keepalive on the link; default 30) and
``poll_s`` (see :class:`~pdflow.transports.ucx_worker.UcxWorker`; default 0: sleep on the
worker's file descriptor between events, which measured best on 2 busy cores).
``python -m pdflow.transports.ucx_bench`` measures it against bare UCX send/recv.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

import msgspec
import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import (
    IncompatiblePeer,
    PeerDisconnected,
    PeerUnreachable,
    Transport,
    TransportClosed,
    TransportError,
    byte_view,
)
from pdflow.transports.sockets import (
    Acceptor,
    address_of,
    listen_inet,
    recv_exact,
    resolve,
    split_address,
)
from pdflow.transports.ucx_link import (
    FRAME,
    GREETING,
    MAGIC,
    MAX_HEADER,
    PIECE,
    SCRATCH,
    WELCOME,
    WIRE_VERSION,
    Conn,
    Inbound,
    tune,
)
from pdflow.transports.ucx_worker import UCXError, UcxWorker

log = structlog.get_logger()

_OPTIONS = {"timeout_s": 30.0, "poll_s": 0.0}


class _Link:
    """What a sender keeps per address: the live connection, made under ``lock``."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.conn: Conn | None = None
        self.attempts = 0  # connects tried so far
        self.failure: PeerUnreachable | None = None  # why the last one failed

    def drop(self, worker: UcxWorker | None) -> None:
        if self.conn is not None:
            self.conn.close(worker)
            self.conn = None


class UcxTransport(Transport):
    """KV chunks over UCX (shared memory + CMA on one host); see the module docstring."""

    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s, self.poll_s = float(settings["timeout_s"]), float(settings["poll_s"])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvChunkHeader)
        self._worker: UcxWorker | None = None
        self._links: dict[str, _Link] = {}
        self._link_ids = itertools.count(1)
        self.scratch = bytearray(SCRATCH)
        self._acceptor: Acceptor | None = None

    def _ucx(self) -> UcxWorker:
        if self._worker is None:
            self._worker = UcxWorker(self.poll_s)
        return self._worker

    # --- sending ---------------------------------------------------------------------------

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        self._check_open()
        payload = byte_view(data)
        if payload.nbytes != header.nbytes:
            raise ValueError(f"data has {payload.nbytes} bytes, header.nbytes is {header.nbytes}")
        encoded = self._encoder.encode(header)
        if len(encoded) > MAX_HEADER:
            raise ValueError(f"chunk header of {len(encoded)} bytes is over {MAX_HEADER}")
        head = FRAME.pack(MAGIC, WIRE_VERSION, len(encoded)) + encoded
        link = self._links.get(address)
        if link is None:
            split_address(address, "ucx")  # ValueError before anything is kept for it
            link = self._links.setdefault(address, _Link())
        attempts, conn = link.attempts, None
        try:
            async with link.lock:  # FIFO: writes are posted in call order
                self._check_open()
                if link.conn is None or not link.conn.alive():
                    link.drop(self._worker)
                    if link.failure is not None and link.attempts > attempts:
                        # it failed while we queued: fail too rather than wait out a timeout each
                        raise type(link.failure)(*link.failure.args)
                    await self._connect(address, link)
                conn, worker = link.conn, self._ucx()
                assert conn is not None
                requests = [worker.send(conn.endpoint, head, conn.tag)]
                for start in range(0, payload.nbytes, PIECE):
                    requests.append(worker.send(conn.endpoint, payload[start : start + PIECE], conn.tag | 1))
            for request in reversed(requests):  # the last done means (nearly) all are: one wait
                if not await conn.finish(worker, request):
                    raise PeerDisconnected(f"lost connection to {address}")
        except BaseException as exc:
            if conn is not None:  # cancelled or failed mid-write: this link is done for
                conn.close(self._worker)
            if self._closed and isinstance(exc, (TransportError, UCXError, OSError)):
                raise TransportClosed(f"ucx transport closed while writing to {address}") from exc
            if isinstance(exc, UCXError):
                log.warning("kv.conn.lost", peer=address, error=str(exc))
                raise PeerDisconnected(f"UCX failed writing to {address}: {exc}") from exc
            if isinstance(exc, PeerDisconnected):
                log.warning("kv.conn.lost", peer=address, error=str(exc))
            raise

    async def _connect(self, address: str, link: _Link) -> None:
        """TCP connect, handshake and UCX endpoint (within ``timeout_s``); sets ``link.conn``."""
        host, port = split_address(address, "ucx")
        loop = asyncio.get_running_loop()
        link.attempts += 1
        link.failure = None
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                family, sockaddr = await resolve(host, port)
                sock = socket.socket(family, socket.SOCK_STREAM)
                tune(sock, self.timeout_s)
                await loop.sock_connect(sock, sockaddr)
                await loop.sock_sendall(sock, GREETING.ours)
                refused = await GREETING.check(sock)
                if isinstance(refused, IncompatiblePeer):
                    sock.close()
                    link.failure = IncompatiblePeer(f"{address} {refused}")
                    raise link.failure
                if refused is not None:
                    raise ConnectionError("closed during the handshake")
                welcome = bytearray(WELCOME.size)
                if await recv_exact(sock, memoryview(welcome)) < WELCOME.size:
                    raise ConnectionError("closed during the handshake")
                link_id, length = WELCOME.unpack(welcome)
                worker_address = bytearray(length)
                if await recv_exact(sock, memoryview(worker_address)) < length:
                    raise ConnectionError("closed during the handshake")
            endpoint = self._ucx().endpoint(bytes(worker_address))
        except (OSError, TimeoutError, UCXError) as exc:
            if sock is not None:
                sock.close()
            reason = str(exc) or f"no answer within {self.timeout_s} s"
            link.failure = PeerUnreachable(f"cannot connect to {address}: {reason}")
            raise link.failure from exc
        link.conn = Conn(sock, link_id << 1, endpoint)
        log.debug("kv.conn.open", peer=address, link=link_id)

    # --- receiving -------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_open()
        if self._acceptor is not None:
            return
        self._ucx()
        listener = listen_inet(self.host, self.port)
        self._address = address_of("ucx", listener)
        self._acceptor = Acceptor(listener, self._serve)
        log.info("kv.listen", address=self._address)

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        """One link: handshake, then chunks (taken in by an ``Inbound``) until the link ends."""
        tune(sock, self.timeout_s)
        conn: Conn | None = None
        inbound: Inbound | None = None
        try:
            link_id = await self._handshake(sock, peer)
            if link_id is not None:
                conn = Conn(sock, link_id << 1)
                inbound = Inbound(self, conn, peer)
                await inbound.ended
        except OSError as exc:
            log.warning("kv.conn.lost", peer=peer, error=str(exc))
        finally:
            if inbound is not None:
                inbound.stop()
            if conn is not None:
                conn.close(None)
            sock.close()

    async def _handshake(self, sock: socket.socket, peer: str) -> int | None:
        """The link id, or None when the peer is not a pdflow ucx sender of this version."""
        if not await GREETING.answer(sock, peer):
            return None
        link_id, address = next(self._link_ids), self._ucx().address
        await asyncio.get_running_loop().sock_sendall(sock, WELCOME.pack(link_id, len(address)) + address)
        log.debug("kv.conn.open", peer=peer, link=link_id)
        return link_id

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        for link in self._links.values():
            if link.conn is not None:
                link.conn.lost()  # writers wake and raise TransportClosed; they close it
                if not link.lock.locked():
                    link.drop(self._worker)
        if self._acceptor is not None:
            await self._acceptor.aclose()
        for link in self._links.values():
            link.drop(self._worker)
        if self._worker is not None:
            self._worker.close(TransportClosed, "ucx transport is closed")
        log.debug("kv.closed", transport="ucx")
