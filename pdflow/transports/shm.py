"""Shared-memory transport: same-host KV chunks copied once, straight into the receiver's memory.

Memory. :meth:`ShmTransport.allocate` makes each region a sealed anonymous memfd
(:mod:`~pdflow.transports.shm_memory`: nothing in ``/dev/shm``, freed by the kernel once its last
holder is gone, crash or not). A sender asks the receiver once for a region's memory, gets the
descriptor over the socket, maps it and keeps the mapping (``max_mappings`` per receiver, least
recently used dropped; all of a receiver's as soon as its connection breaks). Each write is then
one copy from the caller's buffer into the mapping at the offset, between a BEGIN and an END
doorbell; the receiver verifies the checksum on its own view. Regions made with :meth:`register`
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
import time
from typing import Any

import msgspec
import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports import shm_wire as wire
from pdflow.transports.base import (
    ChunkNotice,
    PeerDisconnected,
    Transport,
    TransportError,
    UnknownRegion,
    byte_view,
)
from pdflow.transports.shm_link import Link
from pdflow.transports.shm_memory import STREAM, Segment, copy
from pdflow.transports.sockets import Acceptor, listen_abstract_unix, send_gathered

log = structlog.get_logger()

_SCRATCH = 1 << 16
_OPTIONS = {"timeout_s": 30.0, "max_mappings": 256, "thread_copy_bytes": 16 << 20}


class ShmTransport(Transport):
    """KV chunks through shared memory on one host; see the module docstring."""

    name = "shm"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        super().__init__(host, port, **options)
        settings = self._settings(_OPTIONS)
        self.timeout_s = float(settings["timeout_s"])
        self.max_mappings = int(settings["max_mappings"])
        self.thread_copy_bytes = int(settings["thread_copy_bytes"])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvChunkHeader)
        self._links: dict[str, Link] = {}
        self._segments: dict[int, Segment] = {}
        self._last_segment = 0
        self._senders: dict[socket.socket, set[int]] = {}  # connection -> regions it asked about
        self._acceptor: Acceptor | None = None

    # --- regions ---------------------------------------------------------------------------

    def allocate(self, region: int, nbytes: int) -> memoryview:
        """A region in shared memory that senders map and write into directly (one copy)."""
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

    # --- sending ---------------------------------------------------------------------------

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        self._check_open()
        payload = byte_view(data)
        if payload.nbytes != header.nbytes:
            raise ValueError(f"data has {payload.nbytes} bytes, header.nbytes is {header.nbytes}")
        link = self._links.get(address)
        if link is None:
            wire.socket_name(address)  # ValueError before anything is kept for it
            link = self._links.setdefault(address, Link(address, self.max_mappings, self.timeout_s))
        attempts = link.attempts
        async with link.lock:
            try:
                self._check_open()
                if not link.usable():
                    link.close()
                    if link.failure is not None and link.attempts > attempts:
                        # it failed while we queued: fail too rather than wait out a timeout each
                        raise type(link.failure)(*link.failure.args)
                    await link.connect()
                await self._send_chunk(link, header, payload)
                self._check_open()  # closed mid-copy: its END may not go out, so it did not land
            except BaseException as exc:
                link.close()
                if (error := self._write_error(exc, address)) is exc:
                    raise
                raise error from exc
            finally:
                if self._closed:
                    link.close()

    async def _send_chunk(self, link: Link, header: KvChunkHeader, payload: memoryview) -> None:
        target = await link.target(header.region)
        sock, encoded = link.sock, self._encoder.encode(header)
        assert sock is not None

        def op(kind: int, segment: int = 0) -> bytes:
            return wire.OP.pack(kind, len(encoded), header.region, segment)

        if target is STREAM:
            await send_gathered(sock, link.frame(op(wire.CHUNK) + encoded), payload)
            return
        end = header.offset + header.nbytes
        if target is None or header.offset < 0 or end > target[1].nbytes:
            await send_gathered(sock, link.frame(op(wire.SKIP) + encoded))
            return
        segment, view = target
        await send_gathered(sock, link.frame(op(wire.BEGIN, segment) + encoded))
        await copy(view[header.offset : end], payload, self.thread_copy_bytes)  # the one copy
        link.ended()

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
            if not await wire.GREETING.answer(conn, peer):
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
                    if isinstance(begun, memoryview):
                        notice = self._landed(current, begun)
                    else:
                        notice = ChunkNotice(current, begun, time.monotonic())
                    current = begun = None
                    self._post(notice)
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
                        self._post(ChunkNotice(current, self._skipped(current), time.monotonic()))
                    current = None
                else:
                    raise PeerDisconnected(f"the sender broke the protocol (message {kind})")
        except (OSError, PeerDisconnected) as exc:
            log.warning("kv.shm.conn.lost", peer=peer, error=str(exc), mid_chunk=current is not None)
            if current is not None:
                error = PeerDisconnected(f"{peer} disconnected mid-chunk: {exc}")
                self._post(ChunkNotice(current, error, time.monotonic()))
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
        span = self._landing(header)
        found = self._segments.get(header.region)
        if isinstance(span, memoryview) and (found is None or found.id != segment):
            return UnknownRegion(f"region {header.region} was unregistered while landing")
        return span

    def _skipped(self, header: KvChunkHeader) -> TransportError:
        span = self._landing(header)
        if isinstance(span, TransportError):
            return span
        return UnknownRegion(f"region {header.region} was not registered when the chunk was sent")

    async def _receive_payload(self, inbox: wire.Inbox, header: KvChunkHeader) -> None:
        span = self._landing(header)
        if isinstance(span, TransportError):  # read it into scratch space, keep the connection
            scratch = memoryview(bytearray(min(_SCRATCH, header.nbytes)))
            for start in range(0, header.nbytes, _SCRATCH):
                await inbox.into(scratch[: min(_SCRATCH, header.nbytes - start)])
            self._post(ChunkNotice(header, span, time.monotonic()))
        else:
            await inbox.into(span)
            self._post(self._landed(header, span))

    # --- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        readers = [link.reader for link in self._links.values() if link.reader is not None]
        for link in self._links.values():
            if link.lock.locked():
                link.shutdown()
            else:
                link.close()  # after the last write's END, if the loop has not sent it yet
        if self._acceptor is not None:
            await self._acceptor.aclose(*readers)
        else:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        for region in list(self._segments):  # the memory goes with the last view the caller holds
            self.unregister(region)
        log.debug("kv.shm.closed", address=self._address)
