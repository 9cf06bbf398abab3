"""The control plane: how a stage sends and receives msgspec messages.

:class:`Bus` is the interface a stage is handed (so a stage can be unit-tested on a
:class:`~pdflow.runtime.memory_bus.MemoryHub`'s bus, with no processes). :class:`ZmqBus` is the
one processes use: every stage replica binds one PULL inbox at its control address; peers reach
it through PUSH sockets made on first use, which greet it with a :class:`~pdflow.messages.Hello`.
The launcher has a PULL (ready, heartbeats, failures) and a PUB (stage down/up/status).

Every frame starts with the sender's protocol version (2 bytes). A frame of another version is
refused, never decoded as ours: the receiver logs who sent it (from its Hello) and tells the
launcher (:class:`~pdflow.messages.ProtocolRefused`), which stops the pipeline naming both versions.

Nothing a peer sends ends a receive loop: a frame over :data:`MAX_FRAME_BYTES` is refused by
ZeroMQ itself (the peer is disconnected), one that does not decode is dropped, logged (sparingly)
and counted. With the pipeline's keys (:mod:`pdflow.security`) every socket speaks CURVE, only
the pipeline's own processes can connect, and :meth:`Bus.recv_from` names the replica that sent
each message, as the handshake proved it.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdflow.messages import (
    LAUNCHER_MESSAGES,
    PROTOCOL_VERSION,
    Hello,
    Message,
    ProtocolMismatch,
    ProtocolRefused,
    StageDown,
    StageStatus,
    StageUp,
    check_hello,
    decoder,
)
from pdflow.runtime.kinds import message_types
from pdflow.security.curve import PipelineAuthenticator, as_client, as_server, sender_of
from pdflow.security.keys import LAUNCHER, StageKeys, parse_identity

log = structlog.get_logger()

_HWM = 100_000  # messages queued per peer before send() waits: far above any batch we make
_LINGER_MS = 500  # on close, give queued messages this long to leave
MAX_FRAME_BYTES = 16 * 2**20  # far above any control message (a prompt of 1M token ids is 5 MiB)
_LOGGED_DROPS = 20  # then one line per thousand
Sender = tuple[str, int]  # (stage, replica); ("launcher", 0) for the launcher
VERSION = struct.Struct(">H")
_OURS = VERSION.pack(PROTOCOL_VERSION)
FROM_LAUNCHER: tuple[type, ...] = (StageDown, StageUp, StageStatus)


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = _HWM,
    linger_ms: int = _LINGER_MS,
    secure: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """The one place sockets are made: high-water marks, linger and the largest frame set on
    purpose; ``secure`` (from :func:`server_security` / :func:`client_security`) before it binds
    or connects."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if secure is not None:
        secure(sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


def server_security(keys: StageKeys | None) -> Callable[[zmq.Socket], None] | None:
    return None if keys is None else (lambda sock: as_server(sock, keys))


def client_security(keys: StageKeys | None, server: str) -> Callable[[zmq.Socket], None] | None:
    return None if keys is None else (lambda sock: as_client(sock, keys, server))


def sender_identity(frame: zmq.Frame) -> Sender | None:
    """Who sent ``frame``, as the CURVE handshake proved it (None without CURVE)."""
    name = sender_of(frame)
    if name is None:
        return None
    return (LAUNCHER, 0) if name == LAUNCHER else parse_identity(name)


class DropCounter:
    """Counts frames dropped for one reason and logs the first few, then one in a thousand, so
    that a flood of junk cannot flood the log."""

    def __init__(self, event: str):
        self.event, self.count = event, 0

    def drop(self, **fields) -> None:
        self.count += 1
        if self.count <= _LOGGED_DROPS or self.count % 1000 == 0:
            log.warning(self.event, dropped=self.count, **fields)


class Framing:
    """Encodes messages into version-prefixed frames and decodes frames of our version only."""

    def __init__(self, types: tuple[type, ...]):
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = decoder(types)

    def encode(self, message: Message) -> bytes:
        return _OURS + self._encode(message)

    def decode(self, frame: bytes) -> Message:
        """The message in ``frame``; ProtocolMismatch for another version's frame."""
        if frame[:2] != _OURS:
            theirs = self.version_of(frame)
            raise ProtocolMismatch(f"a frame of pdflow protocol {theirs}, this process speaks {PROTOCOL_VERSION}")
        return self._decoder.decode(memoryview(frame)[2:])

    @staticmethod
    def version_of(frame: bytes) -> int | None:
        return VERSION.unpack(frame[:2])[0] if len(frame) >= 2 else None

    @staticmethod
    def foreign(frame: bytes, cls: type) -> Message | None:
        """A ``cls`` (Hello, Ready: layouts that never change) read from a frame of any version,
        to name its sender; None when the frame holds something else."""
        try:
            return msgspec.msgpack.decode(memoryview(frame)[2:], type=cls)
        except Exception:  # anything hostile bytes make msgspec raise
            return None


class Bus(ABC):
    """One stage replica's control-plane endpoints (the contract every bus keeps).

    ``send`` and ``broadcast`` never block on a slow peer beyond its high-water mark; ``recv``
    returns the next message for this stage (greetings are consumed, not returned) and raises
    nothing for a malformed or foreign frame (it is logged and skipped).
    """

    stage: str
    replica: int

    @abstractmethod
    def start(self) -> None:
        """Bind the inbox and connect to the launcher (before any send or recv)."""

    @abstractmethod
    async def send(self, stage: str, replica: int, message: Message) -> None: ...

    @abstractmethod
    async def broadcast(self, stage: str, message: Message) -> None:
        """``message`` to every replica of ``stage``."""

    @abstractmethod
    async def send_launcher(self, message: Message) -> None: ...

    @abstractmethod
    async def recv_from(self) -> tuple[Sender | None, Message]:
        """The next message for this stage and who sent it: ``(stage, replica)`` as the plane
        authenticated it, or None where the plane cannot say (no keys, or in one process)."""

    async def recv(self) -> Message:
        return (await self.recv_from())[1]

    def counters(self) -> dict[str, int]:
        """What the bus refused or dropped, for the stage's heartbeat."""
        return {}

    @abstractmethod
    async def recv_launcher(self) -> Message: ...

    @abstractmethod
    def close(self) -> None: ...


class ZmqBus(Bus):
    """The bus of a stage process: ZeroMQ sockets to its peers and the launcher."""

    def __init__(self, pipeline, stage: str, replica: int, types: tuple[type, ...] | None = None,
                 keys: StageKeys | None = None):
        self.pipeline, self.stage, self.replica = pipeline, stage, replica
        self.keys = keys
        self.ctx = zmq.asyncio.Context()
        self.authenticator: PipelineAuthenticator | None = None
        self.malformed = DropCounter("bus.message.malformed")
        self.framing = Framing(types or message_types(pipeline))
        self._launcher_framing = Framing(FROM_LAUNCHER)
        self._peers: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        self._refused: set[tuple[str, int, int]] = set()
        self.inbox: zmq.asyncio.Socket | None = None
        self.to_launcher: zmq.asyncio.Socket | None = None
        self.from_launcher: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        if self.keys is not None:
            self.authenticator = PipelineAuthenticator(self.ctx, self.keys)
            self.authenticator.start()
        address = self.pipeline.stages[self.stage].control_bind_address(self.replica)
        self.inbox = make_socket(self.ctx, zmq.PULL, bind=address, secure=server_security(self.keys))
        control = self.pipeline.control
        to_launcher = client_security(self.keys, LAUNCHER)
        self.to_launcher = make_socket(self.ctx, zmq.PUSH, connect=control.pull_address, secure=to_launcher)
        self.from_launcher = make_socket(self.ctx, zmq.SUB, connect=control.pub_address, secure=to_launcher)

    def _peer(self, stage: str, replica: int) -> zmq.asyncio.Socket:
        sock = self._peers.get((stage, replica))
        if sock is None:
            address = self.pipeline.stages[stage].control_address(replica)
            secure = client_security(self.keys, f"{stage}/{replica}")
            sock = make_socket(self.ctx, zmq.PUSH, connect=address, secure=secure)
            sock.send(self.framing.encode(Hello(PROTOCOL_VERSION, self.stage, self.replica, os.getpid())))
            self._peers[(stage, replica)] = sock
        return sock

    async def send(self, stage: str, replica: int, message: Message) -> None:
        await self._peer(stage, replica).send(self.framing.encode(message))

    async def broadcast(self, stage: str, message: Message) -> None:
        data = self.framing.encode(message)
        for replica in range(self.pipeline.stages[stage].replicas):
            await self._peer(stage, replica).send(data)

    async def send_launcher(self, message: Message) -> None:
        await self.to_launcher.send(self.framing.encode(message))

    async def recv_from(self) -> tuple[Sender | None, Message]:
        while True:
            received = await self.inbox.recv(copy=False)
            sender = sender_identity(received) if self.keys is not None else None
            frame = received.bytes
            try:
                message = self.framing.decode(frame)
            except ProtocolMismatch:
                await self._refuse(frame, sender)
                continue
            except Exception as exc:  # whatever hostile bytes make msgspec raise: this frame only
                self.malformed.drop(bytes=len(frame), sender=sender, error=str(exc)[:200])
                continue
            if isinstance(message, Hello):
                continue  # same version (checked above): nothing more to know
            return sender, message

    def counters(self) -> dict[str, int]:
        counts = {"control_malformed": self.malformed.count}
        if self.authenticator is not None:
            counts["control_refused_peers"] = self.authenticator.refused
        return counts

    async def _refuse(self, frame: bytes, sender: Sender | None) -> None:
        """A frame of another version: reported to the launcher (which stops the pipeline) only
        when it is the greeting of a replica of this pipeline, from that replica."""
        hello = self.framing.foreign(frame, Hello)
        if hello is None or sender not in (None, (hello.stage, hello.replica)):
            self.malformed.drop(bytes=len(frame), sender=sender, error=f"a frame of pdflow protocol "
                                f"{self.framing.version_of(frame)}, this process speaks {PROTOCOL_VERSION}")
            return
        try:
            check_hello(hello)
        except ProtocolMismatch as exc:
            key = (hello.stage, hello.replica, hello.protocol_version)
            log.error("protocol.mismatch", error=str(exc), action="refused")
            if key not in self._refused:  # tell the launcher once per peer
                self._refused.add(key)
                await self.send_launcher(ProtocolRefused(self.stage, self.replica, str(exc)))

    async def recv_launcher(self) -> Message:
        while True:
            frame = await self.from_launcher.recv()
            try:
                return self._launcher_framing.decode(frame)
            except ProtocolMismatch:
                raise  # the launcher speaks another version: this stage cannot go on
            except Exception as exc:
                self.malformed.drop(bytes=len(frame), sender="launcher", error=str(exc)[:200])

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.destroy(linger=_LINGER_MS)


def launcher_framing() -> Framing:
    """What the launcher decodes: the stage -> launcher messages."""
    return Framing(LAUNCHER_MESSAGES)
