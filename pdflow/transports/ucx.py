"""UCX transport: KV chunks as ucxx tagged messages, received straight into the registered region.

Connecting. A receiver listens on ``ucx://host:port``, a plain TCP socket. A sender connects
there once per address and both say HELLO (magic ``b"PDUX"``, wire version, pdflow protocol
version; a mismatch is :class:`~pdflow.transports.base.IncompatiblePeer`); the receiver adds
WELCOME: a link id and its UCX *worker address*. The sender makes its UCX endpoint from that
worker address with UCX error handling off: that is what lets UCX use shared memory and CMA
(the ucxx listener path, and error handling, restrict it to TCP). Only for a receiver in the
sender's own network namespace (its address is one of the sender's): across namespaces on one
machine UCX would still pick shared memory, but its wake-ups (abstract unix sockets) do not
cross, and a sleeping receiver never sees the chunks; any other peer gets error handling on.
The worker addresses are thus exchanged per link over this connection, not through the control
plane: the receiver keeps one stable address across restarts (a worker address is new with
every worker), and the connection stays open, silent, for the life of the link as each side's
liveness check. The kernel closes it the moment either process dies (TCP keepalive notices a
vanished host in about ``timeout_s``), which UCX without error handling never reports: a write
to a dead or killed receiver would otherwise wait forever.

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
``pdflow bench transfer --transports ucx`` measures it against bare UCX send/recv (``ucx-raw``).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport
from pdflow.transports.errors import PeerDisconnected, PeerUnreachable, TransportClosed
from pdflow.transports.sockets import Acceptor, address_of, dial, listen_inet, peer_is_local, split_address
from pdflow.transports.ucx_link import (
    FRAME,
    GREETING,
    MAGIC,
    MAX_HEADER,
    PIECE,
    WELCOME,
    WIRE_VERSION,
    Conn,
    Inbound,
    read_welcome,
    tune,
)
from pdflow.transports.ucx_worker import UCXError, UcxWorker

log = structlog.get_logger()

_OPTIONS = {"timeout_s": 30.0, "poll_s": 0.0}


class UcxTransport(Transport):
    """KV chunks over UCX (shared memory + CMA on one host); see the module docstring."""

    name = "ucx"
    _lost_errors = (OSError, UCXError)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s, self.poll_s = float(settings["timeout_s"]), float(settings["poll_s"])
        self._worker: UcxWorker | None = None
        self._link_ids = itertools.count(1)
        self._acceptor: Acceptor | None = None

    def _ucx(self) -> UcxWorker:
        if self._worker is None:
            self._worker = UcxWorker(self.poll_s)
        return self._worker

    # --- sending (the steps of Transport.write) ------------------------------------------------

    def _peer(self, address: str) -> str:
        split_address(address, "ucx")
        return address

    async def _connect(self, peer: str) -> Conn:
        """TCP connect and handshake, then the UCX endpoint to the worker address it brought."""
        sock, welcome = await dial(peer, GREETING, self.timeout_s, setup=lambda s: tune(s, self.timeout_s),
                                   key=self.proof_key,
                                   welcome=read_welcome)  # fmt: skip
        link_id, worker_address = welcome  # type: ignore[misc]
        try:
            endpoint = self._ucx().endpoint(worker_address, error_handling=not peer_is_local(sock))
        except UCXError as exc:
            sock.close()
            raise PeerUnreachable(f"cannot connect to {peer}: {exc}") from exc
        log.debug("kv.conn.open", peer=peer, link=link_id)
        return Conn(sock, peer, link_id << 1, self._ucx(), endpoint)

    async def _send(self, link: Conn, address: str, header: KvChunkHeader, payload: memoryview) -> Any:
        """Post the header and the payload's pieces (UCX keeps one endpoint's messages in order)."""
        encoded = self._encoder.encode(header)
        if len(encoded) > MAX_HEADER:
            raise ValueError(f"chunk header of {len(encoded)} bytes is over {MAX_HEADER}")
        head = FRAME.pack(MAGIC, WIRE_VERSION, len(encoded)) + encoded
        requests = [link.worker.send(link.endpoint, head, link.tag)]
        for start in range(0, payload.nbytes, PIECE):
            requests.append(link.worker.send(link.endpoint, payload[start : start + PIECE], link.tag | 1))
        return requests, head  # UCX reads head from its own memory until it is sent: keep it alive

    async def _finish(self, link: Conn, pending: tuple[list[Any], bytes]) -> None:
        for request in reversed(pending[0]):  # the last done means (nearly) all are: one wait
            if not await link.finish(request):
                raise PeerDisconnected(f"lost connection to {link.peer}")

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
                conn = Conn(sock, peer, link_id << 1, self._ucx())
                inbound = Inbound(conn, self._regions.landing, self._arrived)
                await inbound.ended
        except OSError as exc:
            log.warning("kv.conn.lost", peer=peer, error=str(exc))
        finally:
            if inbound is not None:
                inbound.stop()
            if conn is not None:
                conn.close()
            sock.close()

    async def _handshake(self, sock: socket.socket, peer: str) -> int | None:
        """The link id, or None when the peer is not a pdflow ucx sender of this version."""
        if not await GREETING.answer(sock, peer, self.proof_key, self.timeout_s):
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
        self._close_links()  # writers wake and raise TransportClosed
        if self._acceptor is not None:
            await self._acceptor.aclose()
        self._close_links(busy=True)
        if self._worker is not None:
            self._worker.close(TransportClosed, "ucx transport is closed")
        log.debug("kv.closed", transport="ucx")
