"""The KV data plane's one interface: one-sided writes into memory the receiver registered.

The model is the one RDMA, UCX, NIXL and Mooncake's transfer engine share. The receiver
registers buffers as numbered *regions* and hands out its :attr:`Transport.address`; a sender
writes a chunk (a :class:`~pdflow.messages.KvChunkHeader` plus its payload) into a peer's region
at an offset; once the bytes have fully landed and their checksum is verified, the receiver gets
a :class:`ChunkNotice` from :meth:`Transport.next_notice`. Every failure is a
:class:`TransportError` subclass, so callers never see a raw ``OSError`` and never hang.

A transport object belongs to the event loop that first uses it. Built-in implementations live
next to this module; :mod:`pdflow.transports` finds them by name.

Implementing one. :meth:`Transport.write` is written once, here: a link per peer, used under a
lock so that writes go out in call order, reconnected by the next write after a failure, errors
mapped to those of :mod:`~pdflow.transports.errors`, the transport's closing honoured. A transport that connects to its
peers supplies only the steps: ``_connect`` (a :class:`~pdflow.transports.links.Link`, which it
can close) and ``_send`` (one chunk on it); see "the steps of write()" below. Receivers take a
chunk's span from ``self._regions.landing`` and report it with ``_arrived``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import msgspec
import structlog

from pdflow.messages import KvChunkHeader
from pdflow.transports.errors import ChunkNotice, PeerDisconnected, TransportClosed, TransportError
from pdflow.transports.links import Link, Route
from pdflow.transports.memory import HOST, HOST_ONLY, MemoryKinds, kind_of
from pdflow.transports.regions import Regions, byte_view

log = structlog.get_logger()

_CLOSED = object()
_LAZY_BYTES = 1 << 20  # allocate() maps buffers this large instead of zero-filling them


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
    shares_memory: ClassVar[bool] = False  # True: peer_memory() maps a receiver's regions here (shm)
    copy_counts: dict[str, int] | None = None  # a sender that counts them: bytes copied, bytes found in place
    sent_bytes: int = 0  # payload bytes of the chunks written so far (after a link's codec: what went out)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.host = host
        self.port = port
        self.options = options
        self._regions = Regions()
        self._notices: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._address: str | None = None  # set by start()
        self.advertised_host: str | None = None  # see advertise()
        self._routes: dict[str, Route] = {}  # sender: by peer
        self._encoder = msgspec.msgpack.Encoder()  # chunk headers travel as msgpack
        self._decoder = msgspec.msgpack.Decoder(KvChunkHeader)
        self.proof_key: bytes | None = None  # see authenticate()

    def authenticate(self, key: bytes | None) -> None:
        """Prove ``key`` (the pipeline's data-plane key) in every connection's handshake and
        refuse peers that do not prove it too (:mod:`pdflow.security.handshake`). Call before
        :meth:`start` or the first :meth:`write`; None (the default) proves nothing. A transport
        whose peers share this process (inproc) has nothing to prove and ignores it."""
        self.proof_key = key

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

    def advertise(self, host: str) -> None:
        """Peers reach this transport at ``host``, not at the address it binds (``0.0.0.0``, or
        an address behind a NAT): :attr:`address` names ``host``. Addresses without a host and
        port (``shm://@name``) are left as they are."""
        self.advertised_host = host

    @property
    def address(self) -> str:
        """What a peer passes to :meth:`write`, e.g. ``tcp://127.0.0.1:5601``; valid after start()."""
        if self._address is None:
            raise TransportError(f"{self.name} transport not started: call start() first")
        return self._address if self.advertised_host is None else with_host(self._address, self.advertised_host)

    def register(self, region: int, buffer: Any) -> None:
        """Make ``buffer`` (writable, contiguous: bytearray, memoryview, numpy array, CPU torch
        tensor) region ``region``. Chunks for it land there from now on.

        Raises ValueError if the id is taken or the buffer is unsuitable. Register before telling
        a sender about the region: a chunk that arrives first gets an UnknownRegion notice.
        """
        self._regions.add(region, buffer)

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        """The kinds of memory (:mod:`~pdflow.transports.memory`) this transport sends from and
        lands in. The default, and every transport that does not say otherwise: host memory
        only. A stage whose KV is elsewhere stages it (:mod:`~pdflow.transports.staging`)."""
        return HOST_ONLY

    def allocate(self, region: int, nbytes: int, memory: str = HOST) -> Any:
        """Allocate ``nbytes`` of memory this transport can receive into, register it as
        ``region`` and return it (valid until :meth:`unregister`): a writable memoryview for host
        memory; for device memory (``memory="cuda:0"``, where :meth:`memory_kinds` lands in
        device memory) a flat ``uint8`` tensor on that device.

        This is how stages get receive buffers: a transport whose peers write into shared or
        pinned memory (shm, RDMA) allocates it there, so KV lands where the stage reads it.
        The default is plain process memory (a large buffer is mapped lazily, so a store's arena
        costs only the pages that fill). ValueError for a kind of memory it cannot land in.
        """
        self._check_lands(memory)
        buffer = memoryview(mmap.mmap(-1, nbytes)) if nbytes >= _LAZY_BYTES else memoryview(bytearray(nbytes))
        self.register(region, buffer)
        return buffer

    def _check_lands(self, memory: str) -> None:
        """ValueError unless this transport can land chunks in ``memory``."""
        if kind_of(memory) not in self.memory_kinds().lands:
            raise ValueError(f"the {self.name} transport cannot land chunks in {memory} memory: it "
                             f"{self.memory_kinds().describe()}; allocate host memory and copy "
                             "(pdflow.transports.staging)")

    def region_memory(self, region: int) -> memoryview | None:
        """The bytes of registered region ``region`` (where chunks for it land), or None."""
        return self._regions.get(region)

    def address_for(self, region: int) -> str:
        """The address a sender passes to :meth:`write` for ``region`` (what NIXL calls the
        remote metadata). Most transports need only :attr:`address`; one whose senders map the
        receiver's memory directly may add where the region lives."""
        return self.address

    async def peer_memory(self, address: str, region: int) -> memoryview | None:
        """Region ``region`` of the receiver at ``address``, mapped into this process, where this
        transport shares memory with it (shm); None where it does not (the default).

        What the caller writes into the view is in the receiver's region at once (the receiver's
        notices still come from :meth:`write`); a :meth:`write` whose ``data`` is already at its
        place in this view copies nothing, so a stage can compute straight into a peer's memory
        and then write only to say so. The view stays valid while the caller holds it (even after
        the receiver unregistered the region or went away: the memory goes with the last holder).
        """
        return None

    def unregister(self, region: int) -> None:
        """Forget a region (idempotent) and release its memory if :meth:`allocate` made it;
        chunks for it later get an UnknownRegion notice.

        A chunk already landing may still write into the old buffer; its notice then carries
        UnknownRegion. Keep the buffer until such notices are in if that matters.
        """
        self._regions.pop(region, None)

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        """Write ``data`` into region ``header.region`` at ``header.offset`` of the peer at ``address``.

        ``data`` is any C-contiguous buffer or CPU torch tensor (sent from its own memory, no
        copy; ValueError if non-contiguous) of exactly ``header.nbytes`` bytes (ValueError
        otherwise). ``header.checksum`` is the caller's (:func:`pdflow.transports.checksum.checksum`);
        the receiver verifies it. Returns once the bytes have left ``data`` (it may be reused);
        landing is reported to the receiver only. Many writes may be in flight at once, to one
        or several peers; those to one address go out in call order.

        Raises PeerUnreachable (cannot connect), PeerDisconnected (connection lost; the next
        write reconnects by itself, e.g. after the peer restarted at the same address) or
        TransportClosed. Cancelling a write mid-payload drops the connection (the receiver gets
        a PeerDisconnected notice for that chunk).
        """
        payload = self._payload(header, data)
        link = None
        try:
            async with self._link_to(address) as link:
                pending = await self._send(link, address, header, payload)
                self._check_open()  # closed meanwhile: it may not all have gone out
            if pending is not None:
                await self._finish(link, pending)
            self.sent_bytes += header.nbytes
            self._route_of(address).sent_bytes += header.nbytes
        except ValueError:
            raise  # from _send, before anything went out: the link stays
        except BaseException as exc:
            if link is not None:  # failed or cancelled mid-chunk: the link's stream is unusable
                link.close()
            if (error := self._write_error(exc, address)) is exc:
                raise
            raise error from exc

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

    # --- the steps of write(), for transports that connect to their peers ---------------------

    _lost_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)  # a send failing so: link lost

    def _peer(self, address: str) -> str:
        """The peer ``address`` names (write() keeps one link per peer); ValueError if it is not
        an address of this transport. Called on the first write to an address, and on every
        write whose address is not itself a peer (verbs adds the region to it)."""
        return address

    async def _connect(self, peer: str) -> Link:
        """Connect to ``peer`` and handshake, within the transport's timeout; the new link.

        Raises PeerUnreachable (IncompatiblePeer when the peer refused), having closed whatever
        it opened; the writes queued behind this one then fail with the same error.
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither _connect/_send nor write()")

    async def _send(self, link: Any, address: str, header: KvChunkHeader, payload: memoryview) -> Any:
        """Send one chunk on ``link`` (a link from :meth:`_connect`), from ``payload``'s own memory.

        Runs under the route's lock: one chunk at a time per peer, in call order. Returns None
        when ``payload`` may be reused, else what :meth:`_finish` waits for after the lock is
        released (the next chunk may go out meanwhile). Raise ValueError only before anything
        went out (the link is kept); any other failure closes the link, and a lost connection
        (an error in :attr:`_lost_errors`, or PeerDisconnected) fails the write.
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither _connect/_send nor write()")

    async def _finish(self, link: Any, pending: Any) -> None:
        """Wait until what :meth:`_send` left ``pending`` is done with the payload."""

    @contextlib.asynccontextmanager
    async def _link_to(self, address: str):
        """A usable link to the peer at ``address`` (connected first if need be), under its
        route's lock: one user at a time, in call order."""
        route = self._route_of(address)
        attempts = route.attempts
        async with route.lock:
            self._check_open()
            link = route.link
            if link is None or not link.usable():
                link = await route.reconnect(attempts, self._connect)
                self._check_open()  # closed while connecting
            yield link

    def sent_by_peer(self) -> dict[str, int]:
        """The payload bytes written so far to each peer this sender reached (by its address as
        ``write`` was given it, less any region part)."""
        return {route.peer: route.sent_bytes for route in self._routes.values() if route.sent_bytes}

    def _route_of(self, address: str) -> Route:
        """The route to ``address``: a lookup where the address is its peer's (most writes)."""
        return self._routes.get(address) or self._route(address)

    def _route(self, address: str) -> Route:
        peer = self._peer(address)  # ValueError before anything is kept for it
        route = self._routes.get(peer)
        if route is None:
            route = self._routes[peer] = Route(peer)
        return route

    def _close_links(self, busy: bool = False) -> None:
        """For aclose(): close every link; one a write holds is only interrupted (that write
        closes it) unless ``busy`` (once those writes had their turn)."""
        for route in self._routes.values():
            route.close(busy)

    # --- helpers for implementations -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name} transport is closed")

    def _payload(self, header: KvChunkHeader, data: Any) -> memoryview:
        """``data``'s bytes for a write of ``header`` (TransportClosed once closed; ValueError if
        unsuitable or not ``header.nbytes`` long)."""
        self._check_open()
        payload = byte_view(data)
        if payload.nbytes != header.nbytes:
            raise ValueError(f"data has {payload.nbytes} bytes, header.nbytes is {header.nbytes}")
        return payload

    def _mark_closed(self) -> None:
        """Set the closed flag and wake every next_notice() waiter."""
        if not self._closed:
            self._closed = True
            self._notices.put_nowait(_CLOSED)

    def _write_error(self, exc: BaseException, address: str) -> BaseException:
        """What a write that failed with ``exc`` raises: TransportClosed when the transport was
        closed meanwhile, PeerDisconnected for a lost connection (logged), else ``exc`` itself."""
        lost = isinstance(exc, self._lost_errors)
        if self._closed and (lost or isinstance(exc, TransportError)):
            return TransportClosed(f"{self.name} transport closed while writing to {address}")
        if lost or isinstance(exc, PeerDisconnected):
            log.warning("kv.conn.lost", transport=self.name, peer=address, error=str(exc))
        return PeerDisconnected(f"lost connection to {address}: {exc}") if lost else exc

    def _post(self, notice: ChunkNotice) -> None:
        if not self._closed:
            self._notices.put_nowait(notice)

    def _arrived(self, header: KvChunkHeader, span: memoryview | TransportError, digest: int | None = None) -> None:
        """Post the notice for a chunk whose payload is in ``span`` (see :meth:`Regions.landed`),
        or that did not land (``span`` is why: from :meth:`Regions.landing`, or a lost sender)."""
        if isinstance(span, TransportError):
            self._post(ChunkNotice(header, span, time.monotonic()))
        else:
            self._post(self._regions.landed(header, span, digest))


def with_host(address: str, host: str) -> str:
    """``scheme://old:port`` as ``scheme://host:port`` (IPv6 in brackets); other addresses as they
    are (an abstract socket's, ``shm://@name``, even where its name reads ``host:port``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    if parts.netloc.startswith("@"):
        return address
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.scheme or not parts.hostname or port is None:
        return address
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{parts.scheme}://{shown}:{port}{parts.path}"
