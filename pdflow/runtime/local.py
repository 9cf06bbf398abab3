"""A whole pipeline inside one Python process: every stage replica an asyncio task on this event
loop, the control plane a :class:`~pdflow.runtime.memory_bus.MemoryHub`, KV over the in-process
transport. The same stages and the same HTTP API as ``pdflow run``, for tests and notebooks::

    async with LocalPipeline(Pipeline.default().with_ports(18000)) as running:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused")
        ...

It plays the launcher's part too: it waits for every stage to be ready, and publishes each
replica's status (from its heartbeats) every second, so ``/health`` and the routers see them. A
stage that crashes is reported down (its requests fail at once); it is not restarted.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import structlog

from pdflow.config.pipeline import Pipeline
from pdflow.messages import Heartbeat, Ready, StageDown, StageStatus
from pdflow.runtime.kinds import message_types, stage_class
from pdflow.runtime.memory_bus import MemoryHub
from pdflow.runtime.stage import Stage, StageContext

log = structlog.get_logger()
_STATUS_EVERY_S = 1.0


class LocalPipeline:
    """``async with LocalPipeline(pipeline) as running:`` serves until the block ends.

    ``transport``: what every KV link uses here (``"inproc"`` by default; None keeps the
    pipeline's own). ``model_dir``: the converted model (pulled once when not given).
    """

    def __init__(self, pipeline: Pipeline, model_dir: Path | None = None, transport: str | None = "inproc"):
        self.pipeline = pipeline.with_transport(transport) if transport else pipeline
        from pdflow.config.checks import check_pipeline

        check_pipeline(self.pipeline, cross_process=False)
        self.model_dir = model_dir
        self.stages: dict[tuple[str, int], Stage] = {}
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._in_flight: dict[tuple[str, int], int] = {}
        self._stats: dict[tuple[str, int], dict] = {}
        self._notes: dict[tuple[str, int], dict] = {}
        self._heartbeats: dict[tuple[str, int], int] = {}  # the seq of each one's latest
        self._supervisor: asyncio.Task | None = None

    @property
    def url(self) -> str:
        server = self.pipeline.server
        return f"http://{server.host}:{server.port}"

    def stage(self, name: str, replica: int = 0) -> Stage:
        return self.stages[(name, replica)]

    async def start(self) -> LocalPipeline:
        if self.model_dir is None:
            from pdflow.models import resolve

            source = self.pipeline.model.path or self.pipeline.model.source
            self.model_dir = await asyncio.to_thread(resolve, str(source), progress=False)
        replicas = {name: stage.replicas for name, stage in self.pipeline.stages.items()}
        self.hub = MemoryHub(replicas, message_types(self.pipeline))
        for name, replica in self.pipeline.replicas():
            ctx = StageContext(self.pipeline, name, replica, Path(self.model_dir))
            stage = stage_class(self.pipeline, name)(ctx, self.hub.bus(name, replica))
            self.stages[(name, replica)] = stage
            self._tasks[(name, replica)] = asyncio.get_running_loop().create_task(stage.run())
        try:
            await asyncio.wait_for(self._wait_ready(), self.pipeline.limits.ready_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self._publish_status()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self

    async def _wait_ready(self) -> None:
        ready: set[tuple[str, int]] = set()
        while len(ready) < len(self.stages):
            for key, task in self._tasks.items():
                if task.done():
                    raise RuntimeError(f"stage {key[0]}-{key[1]} failed to start") from task.exception()
            try:
                message = await asyncio.wait_for(self.hub.recv_launcher(), 0.5)
            except asyncio.TimeoutError:
                continue
            if isinstance(message, Ready):
                ready.add((message.stage, message.replica))
            elif isinstance(message, Heartbeat):
                self._in_flight[(message.stage, message.replica)] = message.in_flight
                self._stats[(message.stage, message.replica)] = message.stats
                self._notes[(message.stage, message.replica)] = message.notes
                self._heartbeats[(message.stage, message.replica)] = message.seq

    async def _supervise(self) -> None:
        reported: set[tuple[str, int]] = set()
        next_status = time.monotonic() + _STATUS_EVERY_S
        while True:
            try:
                message = await asyncio.wait_for(self.hub.recv_launcher(), max(0.0, next_status - time.monotonic()))
                if isinstance(message, Heartbeat):
                    self._in_flight[(message.stage, message.replica)] = message.in_flight
                    self._stats[(message.stage, message.replica)] = message.stats
                    self._notes[(message.stage, message.replica)] = message.notes
                    self._heartbeats[(message.stage, message.replica)] = message.seq
            except asyncio.TimeoutError:
                pass
            for key, task in self._tasks.items():
                if task.done() and key not in reported:
                    reported.add(key)
                    error = None if task.cancelled() else task.exception()
                    log.error("stage.died", stage=f"{key[0]}-{key[1]}", error=repr(error))
                    self.hub.publish(StageDown(key[0], key[1], f"crashed: {error!r}"))
            if time.monotonic() >= next_status:
                self._publish_status(reported)
                next_status = time.monotonic() + _STATUS_EVERY_S

    def _publish_status(self, down: set[tuple[str, int]] = frozenset()) -> None:
        for key in self.stages:
            state = "restarting" if key in down else "ready"
            self.hub.publish(StageStatus(key[0], key[1], state, os.getpid(), self._in_flight.get(key, 0), 0,
                                         self._stats.get(key, {}), self._notes.get(key, {}),
                                         self._heartbeats.get(key, -1)))

    async def stop(self) -> None:
        """Ingress first (it drains in-flight requests), then the rest."""
        if self._supervisor is not None:
            self._supervisor.cancel()
        order = sorted(self._tasks, key=lambda key: key[0] != "ingress")
        for key in order:
            self.stages[key].request_stop()
            if key[0] == "ingress":
                await asyncio.wait({self._tasks[key]}, timeout=self.pipeline.limits.shutdown_grace_s + 3)
        await asyncio.wait(set(self._tasks.values()), timeout=5)
        for task in self._tasks.values():
            task.cancel()

    async def __aenter__(self) -> LocalPipeline:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
