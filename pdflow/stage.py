"""What every stage process shares: the bus, readiness, heartbeats, dispatch and shutdown.

A stage's loop is ``recv -> dispatch -> (send)``: :meth:`Stage.handlers` maps each message type
to a handler; handlers must return quickly (long work goes to tasks or worker threads).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import structlog

from pdflow.bus import Bus
from pdflow.messages import PROTOCOL_VERSION, Heartbeat, Ready, StageDown, StageStatus, StageUp
from pdflow.topology import StageConfig, Topology

Handler = Callable[[Any], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class StageContext:
    topology: Topology
    stage: str
    replica: int
    model_dir: Path

    @property
    def config(self) -> StageConfig:
        return self.topology.stages[self.stage]


class Stage:
    name: ClassVar[str]

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.topology = ctx.topology
        self.limits = ctx.topology.limits
        self.replica = ctx.replica
        self.bus = Bus(ctx.topology, ctx.stage, ctx.replica)
        self.log = structlog.get_logger()
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # --- for subclasses ---------------------------------------------------------------------

    async def setup(self) -> None:
        """Load what the stage needs (model, transports); called after the bus is bound."""

    async def teardown(self) -> None:
        """Release what setup() took."""

    def handlers(self) -> dict[type, Handler]:
        return {}

    def in_flight(self) -> int:
        return 0

    def on_stage_down(self, message: StageDown) -> Awaitable[None] | None:
        return None

    def on_stage_up(self, message: StageUp) -> Awaitable[None] | None:
        return None

    def on_stage_status(self, message: StageStatus) -> Awaitable[None] | None:
        return None

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: the launcher stops ingress first, so others have nothing left."""
        self.stopping.set()

    def spawn(self, coro) -> asyncio.Task:
        """Run a task that is kept alive, and whose failure is logged, not lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    # --- the machinery ---------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("stage.task.failed", exc_info=task.exception())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self.bus.start()
        await self.setup()
        await self.bus.send_launcher(Ready(self.ctx.stage, self.replica, os.getpid(), PROTOCOL_VERSION))
        self.log.info("stage.ready", pid=os.getpid())
        loops = [
            self.spawn(self._inbox_loop()),
            self.spawn(self._launcher_loop()),
            self.spawn(self._heartbeat_loop()),
        ]
        await self.stopping.wait()
        self.log.info("stage.stopping", in_flight=self.in_flight())
        for task in loops:
            task.cancel()
        await self.teardown()
        self.bus.close()

    async def _dispatch(self, table: dict[type, Handler], message) -> None:
        handler = table.get(type(message))
        if handler is None:
            self.log.warning("bus.unexpected", message=type(message).__name__)
            return
        try:
            result = handler(message)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.log.exception("bus.handler.failed", message=type(message).__name__)

    async def _inbox_loop(self) -> None:
        table = self.handlers()
        while True:
            await self._dispatch(table, await self.bus.recv())

    async def _launcher_loop(self) -> None:
        table = {StageDown: self.on_stage_down, StageUp: self.on_stage_up, StageStatus: self.on_stage_status}
        while True:
            message = await self.bus.recv_launcher()
            if type(message) in table:
                await self._dispatch(table, message)

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            await self.bus.send_launcher(Heartbeat(self.ctx.stage, self.replica, seq, self.in_flight()))
            seq += 1
            await asyncio.sleep(self.limits.heartbeat_interval_s)
