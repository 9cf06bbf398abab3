"""The control plane: ZeroMQ sockets carrying msgspec messages between stages and the launcher.

Every stage replica binds one PULL inbox at its control address; peers reach it through PUSH
sockets that are created on first use and greet it with a :class:`~pdflow.messages.Hello` (its
protocol version is checked on arrival). The launcher has a PULL (ready, heartbeats, failures)
and a PUB (stage down/up) that every stage connects to.
"""

from __future__ import annotations

import os

import structlog
import zmq
import zmq.asyncio

from pdflow.messages import PROTOCOL_VERSION, Hello, ProtocolMismatch, check_hello, decoder, encoder
from pdflow.config.topology import Topology

log = structlog.get_logger()

_HWM = 100_000  # messages queued per peer before send() waits: far above any batch we make
_LINGER_MS = 500  # on close, give queued messages this long to leave


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = _HWM,
    linger_ms: int = _LINGER_MS,
) -> zmq.Socket:
    """The one place sockets are made: high-water marks and linger set on purpose."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


class Bus:
    """One stage replica's control-plane endpoints."""

    def __init__(self, topology: Topology, stage: str, replica: int):
        self.topology, self.stage, self.replica = topology, stage, replica
        self.ctx = zmq.asyncio.Context()
        self._encode = encoder().encode
        self._decode_inbox = decoder()
        self._decode_launcher = decoder()
        self._peers: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        self.inbox: zmq.asyncio.Socket | None = None
        self.to_launcher: zmq.asyncio.Socket | None = None
        self.from_launcher: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        address = self.topology.stages[self.stage].control_address(self.replica)
        self.inbox = make_socket(self.ctx, zmq.PULL, bind=address)
        control = self.topology.control
        self.to_launcher = make_socket(self.ctx, zmq.PUSH, connect=control.pull_address)
        self.from_launcher = make_socket(self.ctx, zmq.SUB, connect=control.pub_address)

    def _hello(self) -> bytes:
        return self._encode(Hello(PROTOCOL_VERSION, self.stage, self.replica, os.getpid()))

    def _peer(self, stage: str, replica: int) -> zmq.asyncio.Socket:
        sock = self._peers.get((stage, replica))
        if sock is None:
            address = self.topology.stages[stage].control_address(replica)
            sock = make_socket(self.ctx, zmq.PUSH, connect=address)
            sock.send(self._hello())
            self._peers[(stage, replica)] = sock
        return sock

    async def send(self, stage: str, replica: int, message) -> None:
        await self._peer(stage, replica).send(self._encode(message))

    async def broadcast(self, stage: str, message) -> None:
        data = self._encode(message)
        for replica in range(self.topology.stages[stage].replicas):
            await self._peer(stage, replica).send(data)

    async def send_launcher(self, message) -> None:
        await self.to_launcher.send(self._encode(message))

    async def recv(self):
        """The next message for this stage (greetings are checked here, not returned)."""
        while True:
            message = self._decode_inbox.decode(await self.inbox.recv())
            if isinstance(message, Hello):
                try:
                    check_hello(message)
                except ProtocolMismatch as exc:
                    log.error("protocol.mismatch", error=str(exc))
                continue
            return message

    async def recv_launcher(self):
        return self._decode_launcher.decode(await self.from_launcher.recv())

    def close(self) -> None:
        self.ctx.destroy(linger=_LINGER_MS)
