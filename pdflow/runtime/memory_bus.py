"""An in-memory control plane: every stage of a pipeline inside one event loop.

:class:`MemoryHub` holds one inbox per ``(stage, replica)`` and one for the launcher's role; each
:class:`MemoryBus` it hands out keeps :class:`~pdflow.runtime.bus.Bus`'s contract. Messages are
encoded and decoded on the way (as on a socket), so a message type a stage did not declare, or
a message a receiver keeps and mutates, fails here just as it would between processes.

It serves :class:`~pdflow.runtime.local.LocalPipeline` (a whole pipeline in one process) and unit
tests of one stage, which send it messages and read its answers through buses of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdflow.messages import Message
from pdflow.runtime.bus import FROM_LAUNCHER, Bus, Framing, Sender

LAUNCHER = ("launcher", 0)


class MemoryHub:
    """Inboxes by ``(stage, replica)``; ``replicas`` says how many replicas each stage has."""

    def __init__(self, replicas: dict[str, int], types: tuple[type, ...]):
        self.replicas = dict(replicas)
        self.framing = Framing(types)
        self.inboxes: dict[tuple[str, int], asyncio.Queue[tuple[Sender | None, bytes]]] = {}
        self.subscribers: list[asyncio.Queue[bytes]] = []  # the launcher's PUB, one queue per bus
        self._launcher_framing = Framing(FROM_LAUNCHER)
        self.tap: Callable[[str, int, Message], None] | None = None  # sees every message sent

    def inbox(self, stage: str, replica: int) -> asyncio.Queue[tuple[Sender | None, bytes]]:
        return self.inboxes.setdefault((stage, replica), asyncio.Queue())

    def bus(self, stage: str, replica: int = 0) -> MemoryBus:
        return MemoryBus(self, stage, replica)

    def put(self, stage: str, replica: int, message: Message, sender: Sender | None = None) -> None:
        """``message`` into the inbox of ``(stage, replica)``, from ``sender`` (None: unnamed, as
        a test's hand-made message)."""
        if self.tap is not None:
            self.tap(stage, replica, message)
        self.inbox(stage, replica).put_nowait((sender, self.framing.encode(message)))

    def publish(self, message: Message) -> None:
        """What the launcher's PUB does: ``message`` to every bus's launcher inbox."""
        frame = self._launcher_framing.encode(message)
        for queue in self.subscribers:
            queue.put_nowait(frame)

    async def recv_launcher(self) -> Message:
        """The next stage -> launcher message (Ready, Heartbeat, StageFailed, ProtocolRefused)."""
        return self.framing.decode((await self.inbox(*LAUNCHER).get())[1])


class MemoryBus(Bus):
    def __init__(self, hub: MemoryHub, stage: str, replica: int):
        self.hub, self.stage, self.replica = hub, stage, replica
        self._inbox = hub.inbox(stage, replica)
        self._from_launcher: asyncio.Queue[bytes] = asyncio.Queue()
        hub.subscribers.append(self._from_launcher)

    def start(self) -> None:
        pass

    async def send(self, stage: str, replica: int, message: Message) -> None:
        self.hub.put(stage, replica, message, (self.stage, self.replica))

    async def broadcast(self, stage: str, message: Message) -> None:
        for replica in range(self.hub.replicas.get(stage, 1)):
            self.hub.put(stage, replica, message, (self.stage, self.replica))

    async def send_launcher(self, message: Message) -> None:
        self.hub.put(*LAUNCHER, message, (self.stage, self.replica))

    async def recv_from(self) -> tuple[Sender | None, Message]:
        sender, frame = await self._inbox.get()
        return sender, self.hub.framing.decode(frame)

    async def recv_launcher(self) -> Message:
        return self.hub._launcher_framing.decode(await self._from_launcher.get())

    def close(self) -> None:
        if self._from_launcher in self.hub.subscribers:
            self.hub.subscribers.remove(self._from_launcher)
