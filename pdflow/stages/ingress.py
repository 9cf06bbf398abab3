"""ingress: the HTTP front door. Validates, tokenizes, picks a replica of every stage, sends the
work out, and waits for egress's text (the HTTP endpoints themselves are in ``pdflow.serving.http_api``).

It is also the one place that knows which requests went through which replica, so when the
launcher says a replica died, ingress fails those requests at once and cancels them everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import uvicorn
from transformers import AutoConfig

from pdflow.engine import load_tokenizer
from pdflow.messages import (
    Cancel,
    DecodeRequest,
    EgressRequest,
    KvExpected,
    PrefillRequest,
    RequestFailed,
    Route,
    SamplingParams,
    StageDown,
    StageStatus,
    StageUp,
    TextDelta,
)
from pdflow.serving.openai_protocol import ApiError
from pdflow.runtime.stage import Stage

_TIMELINES_KEPT = 1000
_ROUTED = {"disaggregated": ("prefill", "kv_shuttle", "decode", "egress"), "colocated": ("worker", "egress")}


@dataclass(slots=True, eq=False)
class PendingRequest:
    request_id: str
    route: Route
    prompt_len: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: float = field(default_factory=time.monotonic)

    def replica_of(self, stage: str) -> int:
        return {
            "prefill": self.route.prefill,
            "kv_shuttle": self.route.shuttle,
            "decode": self.route.decode,
            "worker": self.route.decode,  # colocated: the worker prefills and decodes
            "egress": self.route.egress,
        }[stage]


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the stage owns SIGTERM/SIGINT: it drains before uvicorn stops
        yield


class IngressStage(Stage):
    name = "ingress"

    async def setup(self) -> None:
        from pdflow.serving.http_api import build_app

        model_dir = self.ctx.model_dir
        self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        config = await asyncio.to_thread(AutoConfig.from_pretrained, model_dir)
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.served_name = self.topology.model.served_name
        self.pending: dict[str, PendingRequest] = {}
        self.timelines: OrderedDict[str, dict] = OrderedDict()
        self.down: set[tuple[str, int]] = set()
        self.stage_status: dict[str, dict] = {}  # "decode-0" -> the launcher's latest StageStatus
        self.accepting = True
        self.routed = _ROUTED[self.topology.engine.mode]
        self._next = {stage: 0 for stage in self.routed}
        server = self.topology.server
        config = uvicorn.Config(
            build_app(self), host=server.host, port=server.port, loop="none", lifespan="off",
            log_level="warning", timeout_graceful_shutdown=1,
        )
        self.server = _Server(config)
        self.server_task = self.spawn(self.server.serve())
        while not self.server.started:
            if self.server_task.done():
                raise RuntimeError(f"HTTP server did not start on {server.host}:{server.port}")
            await asyncio.sleep(0.02)
        self.log.info("http.listening", url=f"http://{server.host}:{server.port}")

    def handlers(self):
        return {TextDelta: self.on_result, RequestFailed: self.on_result}

    def in_flight(self) -> int:
        return len(self.pending)

    def on_result(self, message: TextDelta | RequestFailed) -> None:
        pending = self.pending.get(message.request_id)
        if pending is not None:
            pending.queue.put_nowait(message)

    # --- submitting and cancelling ---------------------------------------------------------

    def _pick(self, stage: str) -> int:
        replicas = self.topology.stages[stage].replicas
        for _ in range(replicas):
            replica = self._next[stage] % replicas
            self._next[stage] += 1
            if (stage, replica) not in self.down:
                return replica
        name = self.topology.stages[stage].display_name
        raise ApiError(f"no {name} replica is up (restarting); retry shortly", status=503, type="server_error")

    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...],
        skip_special_tokens: bool,
    ) -> PendingRequest:
        if not self.accepting:
            raise ApiError("the server is shutting down", status=503, type="server_error")
        if len(self.pending) >= self.limits.max_queued_requests:
            raise ApiError(
                f"too many requests in flight (max_queued_requests={self.limits.max_queued_requests}); retry later",
                status=429, type="rate_limit_error",
            )
        picked = {stage: self._pick(stage) for stage in self.routed}
        if self.topology.colocated:
            worker = picked["worker"]
            route = Route(self.replica, worker, 0, worker, picked["egress"])
        else:
            route = Route(self.replica, picked["prefill"], picked["kv_shuttle"], picked["decode"], picked["egress"])
        pending = PendingRequest(request_id, route, len(prompt_ids))
        self.pending[request_id] = pending
        n = len(prompt_ids)
        bus = self.bus
        # in the order each is needed (the stages also cope with any other order)
        await bus.send("egress", route.egress, EgressRequest(request_id, n, params.max_tokens, stop, skip_special_tokens, route))
        prefill_request = PrefillRequest(request_id, prompt_ids, params, route)
        if self.topology.colocated:
            await bus.send("worker", route.prefill, prefill_request)
            return pending
        await bus.send("kv_shuttle", route.shuttle, KvExpected(request_id, n, route))
        await bus.send("decode", route.decode, DecodeRequest(request_id, n, params, route))
        await bus.send("prefill", route.prefill, prefill_request)
        return pending

    def finish(self, pending: PendingRequest, timeline: dict | None = None) -> None:
        self.pending.pop(pending.request_id, None)
        if timeline:
            self.timelines[pending.request_id] = timeline
            while len(self.timelines) > _TIMELINES_KEPT:
                self.timelines.popitem(last=False)

    def cancel(self, pending: PendingRequest, reason: str) -> None:
        """Forget the request here and tell every stage on its route to free what it holds."""
        self.pending.pop(pending.request_id, None)
        self.log.info("request.cancelled", request_id=pending.request_id, reason=reason)
        message = Cancel(pending.request_id, reason)
        for stage in self.routed:
            self.spawn(self.bus.send(stage, pending.replica_of(stage), message))

    # --- stages going down and up ------------------------------------------------------------

    def on_stage_down(self, message: StageDown) -> None:
        self.down.add((message.stage, message.replica))
        if message.stage not in self.routed:
            return
        for pending in list(self.pending.values()):
            if pending.replica_of(message.stage) == message.replica:
                error = f"{message.stage} replica {message.replica} failed: {message.reason}"
                pending.queue.put_nowait(RequestFailed(pending.request_id, message.stage, error))
                self.cancel(pending, "stage down")

    def on_stage_up(self, message: StageUp) -> None:
        self.down.discard((message.stage, message.replica))

    def on_stage_status(self, message: StageStatus) -> None:
        name = f"{self.topology.stages[message.stage].display_name}-{message.replica}"
        self.stage_status[name] = {
            "state": message.state, "pid": message.pid, "in_flight": message.in_flight,
            "restarts": message.restarts,
        }

    # --- shutting down ----------------------------------------------------------------------

    def request_stop(self) -> None:
        if self.accepting:
            self.accepting = False
            self.spawn(self._drain())

    async def _drain(self) -> None:
        """Take no new requests; give the in-flight ones ``shutdown_grace_s``, then fail them."""
        self.log.info("ingress.draining", in_flight=len(self.pending))
        deadline = time.monotonic() + self.limits.shutdown_grace_s
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for pending in list(self.pending.values()):
            pending.queue.put_nowait(RequestFailed(pending.request_id, "ingress", "the server is shutting down"))
            self.cancel(pending, "shutdown")
        await asyncio.sleep(0.1)  # let the error responses go out
        self.server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.server_task), 2.0)
        self.stopping.set()
