"""Shared-memory transport: same-host KV chunks copied once (or not at all), straight into the receiver's memory.

Memory. :meth:`ShmTransport.allocate` makes each region a sealed anonymous memfd
(:mod:`~pdflow.transports.shm_memory`: nothing in ``/dev/shm``, freed by the kernel once its last
holder is gone, crash or not). A sender asks the receiver once for a region's memory, gets the
descriptor over the socket, maps it and keeps the mapping (``max_mappings`` per receiver, least
recently used dropped; all of a receiver's as soon as its connection breaks). Each write is then
one copy from the caller's buffer into the mapping at the offset, between a BEGIN and an END
doorbell; the receiver verifies the checksum on its own view. :meth:`peer_memory` hands the sender that
mapping itself: a stage that computes its KV straight into it then writes each chunk from where
it already is, and the write copies nothing (only the doorbells go; ``copy_counts`` counts bytes
copied and bytes found in place). Regions made with :meth:`register`
live in the receiver's private memory, which no sender can map: their chunks stream through the
socket, as over tcp. Wire format: :mod:`~pdflow.transports.shm_wire`.

Addresses. The receiver listens on an abstract Unix socket, ``shm://@<name>`` (no file; the
kernel frees the name with the process). ``<name>`` is ``host:port`` when a port is given, else
``host`` unless that is an IP address or localhost, else ``pdflow-<pid>-<random hex>``.

Contracts beyond base.py. A write to a region the receiver lacks returns normally and the
receiver gets an UnknownRegion notice, as over tcp (that answer is not cached). A sender lost
between BEGIN and END, or mid-payload, gives a PeerDisconnected notice. Landing is not
serialised with the receiver's reads: write a span again only after its previous chunk's notice.

Options: ``timeout_s`` (connect + handshake, and a MAP answer; default 30), ``max_mappings``
(default 256), ``thread_copy_bytes`` (copies this large run in a worker thread so the loop stays
responsive; 0: never; default 16 MiB). Linux only; asyncio and uvloop. Only processes of the
same user (or root) may connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from typing import Any

import msgspec
import numpy as np
import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports import shm_wire as wire
from pdflow.transports.base import Transport
from pdflow.transports.errors import PeerDisconnected, TransportError, UnknownRegion
from pdflow.transports.shm_link import ShmLink
from pdflow.transports.shm_memory import STREAM, Segment, copy
from pdflow.transports.sockets import Acceptor, dial, listen_abstract_unix, send_gathered

log = structlog.get_logger()

_SCRATCH = 1 << 16
_OPTIONS = {"timeout_s": 30.0, "max_mappings": 256, "thread_copy_bytes": 16 << 20}


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte is in this process's memory."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


class ShmTransport(Transport):
    """KV chunks through shared memory on one host; see the module docstring."""

    name = "shm"
    shares_memory = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s = float(settings["timeout_s"])
        self.max_mappings = int(settings["max_mappings"])
        self.thread_copy_bytes = int(settings["thread_copy_bytes"])
        self._segments: dict[int, Segment] = {}
        self._last_segment = 0
        self._senders: dict[socket.socket, set[int]] = {}  # connection -> regions it asked about
        self._acceptor: Acceptor | None = None
        self.copy_counts = {"copied_bytes": 0, "in_place_bytes": 0}  # what this sender's writes did

    # --- regions ---------------------------------------------------------------------------

    def allocate(self, region: int, nbytes: int, memory: str = "host") -> memoryview:
        """A region in shared memory that senders map and write into directly (one copy)."""
        self._check_lands(memory)
        if region in self._regions:
            raise ValueError(f"region {region} is already registered")
        if nbytes <= 0:
            return super().allocate(region, nbytes)  # nothing to map
        self._last_segment += 1
        segment = Segment(nbytes, self._last_segment, f"pdflow-kv-{region}")
        self.register(region, segment.view)
        self._segments[region] = segment
        return memoryview(segment.map)

    def unregister(self, region: int) -> None:
        """Also closes its segment, and tells the senders that asked for it to drop it."""
        super().unregister(region)
        segment = self._segments.pop(region, None)
        if segment is not None:
            segment.close()
        for conn, asked in self._senders.items():
            if region in asked:
                asked.discard(region)
                try:
                    sent = conn.send(wire.OP.pack(wire.GONE, 0, region, 0))
                except OSError:
                    sent = 0
                if sent < wire.OP.size:  # never wait here: drop the connection, the sender forgets all
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)

    # --- sending (the steps of Transport.write) ------------------------------------------------

    async def peer_memory(self, address: str, region: int) -> memoryview | None:
        """The receiver's shared segment of ``region`` as this sender mapped it (None for a region
        in its private memory, or one it does not have); see :meth:`Transport.peer_memory`."""
        link = None
        try:
            async with self._link_to(address) as link:
                link.sending = True
                try:
                    target = await link.target(region)
                finally:
                    link.sending = False
        except BaseException as exc:
            if link is not None and not isinstance(exc, TransportError):
                link.close()
            if (error := self._write_error(exc, address)) is exc:
                raise
            raise error from exc
        return target[1] if isinstance(target, tuple) else None

    def _peer(self, address: str) -> str:
        wire.socket_name(address)
        return address

    async def _connect(self, peer: str) -> ShmLink:
        sock, _ = await dial(peer, wire.GREETING, self.timeout_s, unix=wire.socket_name(peer), key=self.proof_key)
        return ShmLink(sock, peer, self.max_mappings, self.timeout_s)

    async def _send(self, link: ShmLink, address: str, header: KvChunkHeader, payload: memoryview) -> None:
        link.sending = True
        try:
            target = await link.target(header.region)
            sock, encoded = link.sock, self._encoder.encode(header)
            assert sock is not None

            def op(kind: int, segment: int = 0) -> bytes:
                return wire.OP.pack(kind, len(encoded), header.region, segment)

            end = header.offset + header.nbytes
            if target is STREAM:
                await send_gathered(sock, link.frame(op(wire.CHUNK) + encoded), payload)
            elif target is None or header.offset < 0 or end > target[1].nbytes:
                await send_gathered(sock, link.frame(op(wire.SKIP) + encoded))
            else:
                segment, view = target
                await send_gathered(sock, link.frame(op(wire.BEGIN, segment) + encoded))
                span = view[header.offset : end]
                if header.nbytes and _address(span) == _address(payload):  # computed in place
                    self.copy_counts["in_place_bytes"] += header.nbytes
                else:
                    await copy(span, payload, self.thread_copy_bytes)  # the one copy
                    self.copy_counts["copied_bytes"] += header.nbytes
                link.ended()
        finally:
            link.sending = False

    # --- receiving -------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_open()
        if self._acceptor is not None:
            return
        name = wire.name_for(self.host, self.port)
        listener = listen_abstract_unix(name)
        self._address = f"shm://@{name}"
        self._acceptor = Acceptor(listener, self._serve)
        log.info("kv.shm.listen", address=self._address)

    async def _serve(self, conn: socket.socket, _: str) -> None:
        """One sender: handshake, then its messages until it closes."""
        conn.setblocking(False)
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        peer, inbox = f"pid {pid}", wire.Inbox(conn)
        current: KvChunkHeader | None = None  # a chunk begun, or mid-payload
        begun: memoryview | TransportError | None = None  # where the begun chunk lands
        self._senders[conn] = set()
        try:
            if uid not in (os.getuid(), 0):
                log.error("kv.shm.peer.rejected", peer=peer, uid=uid)
                return
            if not await wire.GREETING.answer(conn, peer, self.proof_key, self.timeout_s):
                return
            while True:
                op = await inbox.take(wire.OP.size)
                if op is None:
                    if current is not None:
                        raise PeerDisconnected("the sender closed mid-chunk")
                    log.debug("kv.shm.conn.closed", peer=peer)
                    return
                kind, length, region, segment = wire.OP.unpack(op)
                if kind == wire.MAP:
                    self._answer(conn, region)
                elif kind == wire.END and current is not None and begun is not None:
                    self._arrived(current, begun)
                    current = begun = None
                elif kind in (wire.CHUNK, wire.BEGIN, wire.SKIP) and current is None:
                    if length > wire.MAX_HEADER:
                        raise PeerDisconnected(f"a header of {length} bytes")
                    encoded = await inbox.take(length)
                    if encoded is None:
                        raise PeerDisconnected("the sender closed mid-header")
                    try:
                        current = self._decoder.decode(encoded)
                    except msgspec.DecodeError as exc:
                        raise PeerDisconnected(f"malformed header: {exc}") from None
                    if current.nbytes < 0:
                        raise PeerDisconnected(f"a header with nbytes {current.nbytes}")
                    if kind == wire.BEGIN:
                        begun = self._mapped_span(current, segment)
                        continue
                    if kind == wire.CHUNK:
                        await self._receive_payload(inbox, current)
                    else:
                        self._arrived(current, self._skipped(current))
                    current = None
                else:
                    raise PeerDisconnected(f"the sender broke the protocol (message {kind})")
        except (OSError, PeerDisconnected) as exc:
            log.warning("kv.shm.conn.lost", peer=peer, error=str(exc), mid_chunk=current is not None)
            if current is not None:
                self._arrived(current, PeerDisconnected(f"{peer} disconnected mid-chunk: {exc}"))
        finally:
            self._senders.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, region: int) -> None:
        """Reply to MAP: the region's memfd, or that it is private or unknown (never waits)."""
        segment = self._segments.get(region)
        if segment is not None:
            sent = socket.send_fds(conn, [wire.OP.pack(wire.MAPPED, 0, region, segment.id)], [segment.fd])
        else:
            sent = conn.send(wire.OP.pack(wire.PRIVATE if region in self._regions else wire.NONE, 0, region, 0))
        if sent < wire.OP.size:
            raise PeerDisconnected("the sender does not read its replies")
        if region in self._regions:
            self._senders[conn].add(region)

    def _mapped_span(self, header: KvChunkHeader, segment: int) -> memoryview | TransportError:
        span = self._regions.landing(header)
        found = self._segments.get(header.region)
        if isinstance(span, memoryview) and (found is None or found.id != segment):
            return UnknownRegion(f"region {header.region} was unregistered while landing")
        return span

    def _skipped(self, header: KvChunkHeader) -> TransportError:
        span = self._regions.landing(header)
        if isinstance(span, TransportError):
            return span
        return UnknownRegion(f"region {header.region} was not registered when the chunk was sent")

    async def _receive_payload(self, inbox: wire.Inbox, header: KvChunkHeader) -> None:
        span = self._regions.landing(header)
        if isinstance(span, TransportError):  # read it into scratch space, keep the connection
            scratch = memoryview(bytearray(min(_SCRATCH, header.nbytes)))
            for start in range(0, header.nbytes, _SCRATCH):
                await inbox.into(scratch[: min(_SCRATCH, header.nbytes - start)])
        else:
            await inbox.into(span)
        self._arrived(header, span)

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        links = [route.link for route in self._routes.values() if isinstance(route.link, ShmLink)]
        readers = [link.reader for link in links if link.reader is not None]
        self._close_links()  # an idle link sends its last END first, if the loop has not yet
        if self._acceptor is not None:
            await self._acceptor.aclose(*readers)
        else:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        for region in list(self._segments):  # the memory goes with the last view the caller holds
            self.unregister(region)
        log.debug("kv.shm.closed", address=self._address)
