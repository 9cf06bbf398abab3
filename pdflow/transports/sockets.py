"""The socket plumbing the tcp, shm, ucx and verbs transports share: addresses, exact reads, the
handshake on both ends (:class:`Greeting`, :func:`dial`), a sender's link that is one socket, and
the receiver's listening socket with a task per accepted connection."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog

from pdflow.messages import PROTOCOL_VERSION
from pdflow.security import handshake
from pdflow.transports.errors import IncompatiblePeer, PeerUnreachable
from pdflow.transports.links import Link

T = TypeVar("T")

log = structlog.get_logger("pdflow.transports")


def split_address(address: str, scheme: str) -> tuple[str, int]:
    """``tcp://host:port`` (for scheme ``tcp``) -> (host, port); ValueError for anything else."""
    parts = urlsplit(address)
    if parts.scheme != scheme or not parts.hostname or parts.port is None:
        raise ValueError(f"not a {scheme} address: {address!r} (expected {scheme}://host:port)")
    return parts.hostname, parts.port


def address_of(scheme: str, sock: socket.socket) -> str:
    """The ``scheme://host:port`` address a listening inet socket is reached at (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def peer_is_local(sock: socket.socket) -> bool:
    """Whether the peer of connected inet socket ``sock`` is in this network namespace: its
    address is one of this namespace's own (loopback included), which can be bound here. A peer on
    another machine, or in another namespace (container, ``ip netns``) on this one, is not."""
    peer = sock.getpeername()
    with socket.socket(sock.family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((peer[0], 0, *peer[2:]))
        except OSError:
            return False
    return True


async def resolve(host: str, port: int) -> tuple[int, Any]:
    """(address family, socket address) for ``host:port``."""
    try:  # numeric addresses need no resolver thread
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        return family, (host, port)
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]


async def recv_exact(sock: socket.socket, view: memoryview, hasher: Any = None) -> int:
    """Fill ``view`` from ``sock``; fewer bytes than asked only when the peer closed.

    Each read is tried at once and waits on the event loop only when nothing is there (uvloop's
    ``sock_recv_into`` always waits for a loop turn first, which costs more than the read on
    small frames). ``hasher`` (e.g. ``xxhash.xxh3_64()``) is fed each piece as it lands, while
    it is still in cache. Callers that loop over frames yield to the loop once per frame.
    """
    loop, got, want = asyncio.get_running_loop(), 0, view.nbytes
    while got < want:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            break
        if hasher is not None:
            hasher.update(view[got : got + n])
        got += n
    return got


async def send_gathered(sock: socket.socket, head: bytes, payload: memoryview | None = None) -> None:
    """``head`` then ``payload``, gathered by the kernel from both buffers (no joining, no copy in
    Python): one ``sendmsg`` tried at once, then ``sock_sendall`` of whatever is left."""
    try:
        sent = sock.sendmsg([head] if payload is None else [head, payload])
    except BlockingIOError:
        sent = 0
    loop = asyncio.get_running_loop()
    if sent < len(head):
        await loop.sock_sendall(sock, memoryview(head)[sent:])
        sent = len(head)
    if payload is not None and sent - len(head) < payload.nbytes:
        await loop.sock_sendall(sock, payload[sent - len(head) :])


_HELLO = struct.Struct("!4sHH")  # magic, wire version, pdflow protocol version
_PROOF = struct.Struct(f"!B{handshake.NONCE_BYTES}s")  # 1: this end proves the data-plane key; nonce
_LOGGED_REJECTIONS = 20  # then one line per thousand
rejected_handshakes = 0  # in this process: wrong version, no proof, a wrong proof, too slow


@dataclass(frozen=True, slots=True)
class Greeting:
    """The HELLO both ends of a connection send first: the transport's magic, its wire version
    and the pdflow protocol version, then whether this end proves the pipeline's data-plane key
    and a fresh nonce (:mod:`pdflow.security.handshake`). ``kind`` names the transport in errors.

    The receiver reads the sender's HELLO before it answers, so a peer of another version learns
    ours (and why it was refused) whatever else differs."""

    magic: bytes
    wire_version: int
    kind: str

    @property
    def ours(self) -> bytes:
        return _HELLO.pack(self.magic, self.wire_version, PROTOCOL_VERSION)

    def _hello(self, key: bytes | None, nonce: bytes) -> bytes:
        return self.ours + _PROOF.pack(key is not None, nonce)

    async def _read_hello(self, sock: socket.socket) -> tuple[PeerUnreachable | None, bool, bytes]:
        """The peer's HELLO: (why it is refused or None, whether it proves the key, its nonce)."""
        reply = bytearray(_HELLO.size)
        if await recv_exact(sock, memoryview(reply)) < _HELLO.size:
            return PeerUnreachable("closed the connection during the handshake"), False, b""
        magic, wire, protocol = _HELLO.unpack(reply)
        if (magic, wire, protocol) != (self.magic, self.wire_version, PROTOCOL_VERSION):
            return IncompatiblePeer(
                f"is not a pdflow {self.kind} endpoint of this version (magic {magic!r}, wire {wire}, "
                f"protocol {protocol}; ours: wire {self.wire_version}, protocol {PROTOCOL_VERSION})"
            ), False, b""
        proof = bytearray(_PROOF.size)
        if await recv_exact(sock, memoryview(proof)) < _PROOF.size:
            return PeerUnreachable("closed the connection during the handshake"), False, b""
        proves, nonce = _PROOF.unpack(proof)
        return None, bool(proves), nonce

    @staticmethod
    def _mismatch(key: bytes | None, theirs: bool) -> IncompatiblePeer | None:
        if (key is not None) == theirs:
            return None
        return IncompatiblePeer("authenticates its data plane and this end does not" if theirs else
                                "does not prove the pipeline's data-plane key ([security] authenticate "
                                "differs, or it is not a stage of this pipeline)")

    async def greet(self, sock: socket.socket, key: bytes | None) -> PeerUnreachable | None:
        """The sender's side, once connected: HELLOs, then (with ``key``) the mutual proof. None
        when the receiver is a pdflow endpoint of this version holding the same key, else why not
        (PeerUnreachable when it closed first, IncompatiblePeer otherwise)."""
        loop, mine = asyncio.get_running_loop(), handshake.nonce()
        await loop.sock_sendall(sock, self._hello(key, mine))
        refused, proves, theirs = await self._read_hello(sock)
        refused = refused or self._mismatch(key, proves)
        if refused is not None or key is None:
            return refused
        mac = bytearray(handshake.MAC_BYTES)
        if await recv_exact(sock, memoryview(mac)) < handshake.MAC_BYTES:
            return PeerUnreachable("closed the connection during the handshake (a wrong key?)")
        if not handshake.same(bytes(mac), handshake.receiver_mac(key, mine, theirs)):
            return IncompatiblePeer("did not prove it holds this pipeline's data-plane key")
        await loop.sock_sendall(sock, handshake.sender_mac(key, mine, theirs))
        return None

    async def answer(self, sock: socket.socket, peer: str, key: bytes | None = None, timeout_s: float = 30.0) -> bool:
        """The receiver's side: read the sender's HELLO, answer with ours (so that a sender of
        another version learns which), then (with ``key``) prove the key and check the sender's
        proof, all within ``timeout_s``. Whether the sender may write (logged when not)."""
        loop, mine = asyncio.get_running_loop(), handshake.nonce()
        try:
            async with asyncio.timeout(timeout_s):
                refused, proves, theirs = await self._read_hello(sock)
                if isinstance(refused, PeerUnreachable) and not isinstance(refused, IncompatiblePeer):
                    return False
                await loop.sock_sendall(sock, self._hello(key, mine))
                refused = refused or self._mismatch(key, proves)
                if refused is None and key is not None:
                    await loop.sock_sendall(sock, handshake.receiver_mac(key, theirs, mine))
                    mac = bytearray(handshake.MAC_BYTES)
                    if await recv_exact(sock, memoryview(mac)) < handshake.MAC_BYTES or \
                            not handshake.same(bytes(mac), handshake.sender_mac(key, theirs, mine)):
                        refused = IncompatiblePeer("did not prove it holds this pipeline's data-plane key")
        except TimeoutError:
            refused = PeerUnreachable(f"did not finish the handshake within {timeout_s} s")
        if refused is not None:
            _rejected(self.kind, peer, str(refused))
        return refused is None


async def dial(
    address: str,
    greeting: Greeting,
    timeout_s: float,
    *,
    unix: str | None = None,
    setup: Callable[[socket.socket], None] | None = None,
    welcome: Callable[[socket.socket], Awaitable[T]] | None = None,
    key: bytes | None = None,
) -> tuple[socket.socket, T | None]:
    """A sender's connection: connect to ``address``, exchange ``greeting``s, then let
    ``welcome(sock)`` read whatever else the peer says first, all within ``timeout_s``.

    ``address`` is ``<greeting.kind>://host:port`` (TCP), or with ``unix`` the Unix socket of
    that name. ``setup`` tunes the non-blocking socket before it connects. ``key``: the
    pipeline's data-plane key, proved in the handshake (None: no proof). Returns the socket
    and what ``welcome`` returned. Raises PeerUnreachable (nothing there, no answer in time,
    closed; ``welcome`` may raise ConnectionError for that) or IncompatiblePeer, having closed
    the socket, as it does on any other failure or cancellation.
    """
    loop, sock, extra = asyncio.get_running_loop(), None, None
    try:
        async with asyncio.timeout(timeout_s):
            if unix is None:
                family, target = await resolve(*split_address(address, greeting.kind))
            else:
                family, target = socket.AF_UNIX, unix
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            if setup is not None:
                setup(sock)
            await loop.sock_connect(sock, target)
            refused = await greeting.greet(sock, key)
            if refused is None and welcome is not None:
                extra = await welcome(sock)
    except BaseException as exc:
        if sock is not None:
            sock.close()
        if not isinstance(exc, (OSError, TimeoutError)):
            raise
        reason = str(exc) or f"no answer within {timeout_s} s"
        raise PeerUnreachable(f"cannot connect to {address}: {reason}") from exc
    if refused is not None:
        sock.close()
        raise type(refused)(f"{address} {refused}")
    return sock, extra


def _rejected(kind: str, peer: str, reason: str) -> None:
    global rejected_handshakes
    rejected_handshakes += 1
    if rejected_handshakes <= _LOGGED_REJECTIONS or rejected_handshakes % 1000 == 0:
        log.error("kv.handshake.rejected", transport=kind, peer=peer, reason=reason, rejected=rejected_handshakes)


class SocketLink(Link):
    """A sender's link that is one connected socket, on which the receiver never sends: anything
    readable means it closed (or is not a pdflow receiver)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock

    def usable(self) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; any byte: not a pdflow receiver
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def interrupt(self) -> None:
        """Wake whatever waits on the socket (it fails with EPIPE); the write then closes it."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


def listen_inet(host: str, port: int, receive_buffer: int = 0) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (port 0: any free one).
    ``receive_buffer`` is set before listening, so accepted sockets inherit it before their
    window is agreed."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], info[1], info[2])
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.bind(info[4])
        return _listening(sock)
    except OSError:
        sock.close()
        raise


def listen_abstract_unix(name: str) -> socket.socket:
    """A non-blocking Unix stream socket listening on the abstract name ``name`` (no file: it
    disappears with its last descriptor, also after a crash)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        return _listening(sock)
    except OSError:
        sock.close()
        raise


def _listening(sock: socket.socket) -> socket.socket:
    sock.listen(256)
    sock.setblocking(False)
    return sock


class Acceptor:
    """Accepts connections on ``listener`` and runs ``serve(conn, peer)`` for each in a task of
    its own, until :meth:`aclose`; ``peer`` is ``"host:port"`` (empty for a Unix socket)."""

    def __init__(self, listener: socket.socket, serve: Callable[[socket.socket, str], Awaitable[None]]) -> None:
        self.listener = listener
        self._serve = serve
        self._serving: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self.listener)
            except OSError as exc:  # e.g. out of file descriptors: retry soon
                log.warning("kv.accept.failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            peer_name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
            task = loop.create_task(self._serve(conn, peer_name))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def aclose(self, *also: asyncio.Task[Any]) -> None:
        """Stop accepting, cancel every serving task (and ``also``), wait for them, close the
        listening socket."""
        tasks = [self._accepting, *self._serving, *also]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(OSError):
            self.listener.close()
