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

from pdflow.runtime.bus import Bus
from pdflow.messages import PROTOCOL_VERSION, Heartbeat, Ready, StageDown, StageStatus, StageUp
from pdflow.config.topology import StageConfig, Topology

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
        self.crashed: BaseException | None = None

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

    def spawn(self, coro, *, essential: bool = False) -> asyncio.Task:
        """Run a task that is kept alive, and whose failure is logged, not lost. When an
        ``essential`` task (a loop the stage cannot work without) ends, the stage crashes, so the
        launcher restarts it instead of it going on deaf behind its heartbeats."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, essential))
        return task

    # --- the machinery ---------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task, essential: bool) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.log.error("stage.task.failed", task=task.get_coro().__qualname__, exc_info=error)
        if essential and not self.stopping.is_set():
            self.crashed = error or RuntimeError(f"{task.get_coro().__qualname__} ended")
            self.stopping.set()

    async def run(self) -> None:
        # SIGINT stays ignored: a terminal's Ctrl-C reaches the whole process group, and the
        # launcher turns it into SIGTERMs in the right order (ingress drains first)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.request_stop)
        self.bus.start()
        await self.setup()
        await self.bus.send_launcher(Ready(self.ctx.stage, self.replica, os.getpid(), PROTOCOL_VERSION))
        self.log.info("stage.ready", pid=os.getpid())
        loops = [
            self.spawn(self._inbox_loop(), essential=True),
            self.spawn(self._launcher_loop(), essential=True),
            self.spawn(self._heartbeat_loop(), essential=True),
        ]
        await self.stopping.wait()
        self.log.info("stage.stopping", in_flight=self.in_flight())
        for task in loops:
            task.cancel()
        await self.teardown()
        self.bus.close()
        if self.crashed is not None:
            raise RuntimeError("an essential loop of the stage ended") from self.crashed

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
