"""ingress: the HTTP front door. Validates, tokenizes, asks the router for a replica of every
stage, tells each stage what it needs to know of the request (``Stage.admission``), and waits for
the request's text (the HTTP endpoints themselves are in ``pdflow.serving.http_api``).

By default ingress also turns the tokens that prefill and decode send it into text
(:class:`~pdflow.serving.text_stream.TextStream`: incremental UTF-8, stop strings across tokens,
and :class:`StopRequest` to the stage that decodes when one matches): a token reaches the
process that holds the client's connection in one control hop. A pipeline with an egress stage
detokenizes there instead, and ingress takes its :class:`TextDelta` messages.

It is also the one place that knows which requests went through which replica, so when the
launcher says a replica died, ingress acts on those requests at once: each one *migrates*
(:mod:`pdflow.stages.migration`): it is cancelled everywhere and submitted again under a new
internal id, its prompt followed by the tokens already generated, on live replicas, and its
stream goes on with no text repeated or missing. One that cannot (``limits.max_migrations``
used up, or no replica back before its deadline) fails with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pdflow import routing
from pdflow.routing import locality
from pdflow.tokenizing import load_serving_tokenizer, model_limits
from pdflow.kv.blocks import BlockHasher
from pdflow.kv.holdings import Holdings
from pdflow.messages import (
    Cancel,
    KvForgotten,
    KvHoldings,
    RequestFailed,
    Route,
    SamplingParams,
    StageDown,
    StageStatus,
    StageUp,
    StopRequest,
    TextDelta,
    Tokens,
)
from pdflow.routing import NoReplicaAvailable, ReplicaStatus, RoutingRequest
from pdflow.runtime.kinds import stage_class, wired_to
from pdflow.transports import shares_memory
from pdflow.runtime.stage import Stage, Submission
from pdflow.security.keys import load_api_key
from pdflow.serving.http_server import HttpServer, http_server, shared_port_socket
from pdflow.serving.logprobs_format import TokenTexts
from pdflow.serving.metrics import ServingMetrics
from pdflow.serving.openai_responses import system_fingerprint
from pdflow.serving.openai_protocol import ApiError
from pdflow.serving.prompts import PromptBuilder
from pdflow.serving.text_stream import TextStream
from pdflow.stages.kv_admin import KvAdminIngress
from pdflow.stages.migration import MigratingIngress

_TIMELINES_KEPT = 1000
UNROUTED_STATES = ("parked", "draining", "joining")  # the scaler's states: up or not, take no new request


@dataclass(slots=True, eq=False)
class PendingRequest:
    request_id: str  # the client's: every response of the request carries it
    route: Route
    prompt_len: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: float = field(default_factory=time.monotonic)
    submission: Submission | None = None  # as first admitted
    admitted: Submission | None = None  # as admitted last (a migrated request: with what it resumes from)
    text: TextStream | None = None  # its tokens into text, when ingress detokenizes (for ``admitted``)
    internal_id: str = ""  # its id on the pipeline now: request_id, then request_id~1, ~2 after migrations
    generated: list[int] = field(default_factory=list)  # every token generated so far
    sent_chars: int = 0  # the text the client has been given
    cached_tokens: int = 0  # of the first attempt's prompt
    drafts: tuple[int, int] = (0, 0)  # speculative decoding: draft tokens verified and kept (the latest totals)
    attempts: int = 0  # migrations so far
    migrating: bool = False
    abandoned: bool = False  # cancelled (client gone, failed) while it migrated
    first_token_at: float | None = None  # for the metrics: when its first text came, its latest, ...
    last_token_at: float | None = None
    counted_tokens: int = 0  # ... and how many tokens they have counted


class IngressStage(MigratingIngress, KvAdminIngress, Stage):
    kind = "ingress"
    outputs = {"stop": "decode"}  # a stop string matched: the stage that decodes stops (see the module doc)
    server: HttpServer | None = None  # set once setup has started the HTTP server

    async def setup(self) -> None:
        from pdflow.serving.http_api import build_app

        # who may send what: tokens from the stages whose output "tokens" comes here, text from those
        # whose output "text" does (a decode replica may not pass text off as egress's)
        self.senders = {Tokens: wired_to(self.pipeline, "ingress", "tokens"),
                        TextDelta: wired_to(self.pipeline, "ingress", "text")}

        model_dir = self.ctx.model_dir
        self.tokenizer, why = await asyncio.to_thread(load_serving_tokenizer, model_dir)
        if why:
            self.log.info("tokenizer.transformers", reason=why)
        max_positions, vocab_size = await asyncio.to_thread(model_limits, model_dir)
        self.max_context = self.pipeline.model.context(max_positions)
        self.prompts = await asyncio.to_thread(PromptBuilder, self.tokenizer, self.max_context,
                                               self.pipeline.server.max_messages)
        self.api_key = self.keys.api_key if self.keys is not None else load_api_key(self.pipeline.security)
        self.served_name = self.pipeline.model.served_name
        self.vocab_size = vocab_size or len(self.tokenizer)  # a row of logits' width
        self.token_texts = TokenTexts(self.tokenizer)
        self.fingerprint = system_fingerprint(self.pipeline.model.weights)
        self.timelines: OrderedDict[str, dict] = OrderedDict()
        self.down: set[tuple[str, int]] = set()
        self.unrouted: set[tuple[str, int]] = set()  # the scaler's: parked, draining or joining (not down)
        self.stage_status: dict[str, dict] = {}  # "decode-0" -> the launcher's latest StageStatus
        self.reported: dict[tuple[str, int], int] = {}  # (stage, replica) -> in flight, from heartbeats
        self.assigned: Counter[tuple[str, int]] = Counter()  # (stage, replica) -> our requests there now
        self.accepting = True
        self.metrics = ServingMetrics(self)
        self.routed = [name for name in self.pipeline.stages if name != "ingress"]
        self.admitted_by = [(name, stage_class(self.pipeline, name)) for name in reversed(self.routed)]
        self.router = routing.create(self.pipeline.router.policy, self.pipeline.router.options)
        self.holdings = Holdings() if self.router.uses_holdings else None  # what each store holds, as it says
        self.hasher = BlockHasher.for_pipeline(self.pipeline)
        self.keeps_kv = locality.kv_stages(self.pipeline, "holds_kv")
        self.pairings = locality.pairings(self.pipeline, shares_memory)
        self.route_order = locality.route_order(self.routed, self.pairings)
        self.hosts_of = {name: [self.pipeline.host_name_of(name, i) for i in range(self.pipeline.stages[name].replicas)]
                         for name in self.routed}  # each replica's host, for the pairings
        server = self.pipeline.server
        port = server.port_of(self.replica)
        self.server = http_server(build_app(self), server.host, port, server.header_timeout_s)
        sockets = [shared_port_socket(server.host, port)] if server.reuse_port else None
        self.server_task = self.spawn(self.server.serve(sockets))
        while not self.server.started:
            if self.server_task.done():
                raise RuntimeError(f"HTTP server did not start on {server.host}:{port}")
            await asyncio.sleep(0.02)
        self.log.info("http.listening", url=f"http://{server.host}:{port}", shared_port=server.reuse_port)
        self.spawn(self._reap_loop(), essential=True)

    async def teardown(self) -> None:
        self.prompts.close()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.metrics.window_p90(self.pipeline.scaler.window_s)}

    def may_act(self, sender, message, request_id: str) -> bool:
        allowed = self.senders.get(type(message))
        if sender is not None and allowed is not None and sender[0] not in allowed:
            return False
        return super().may_act(sender, message, request_id)

    def handlers(self):
        return {TextDelta: self.on_result, RequestFailed: self.on_result, Tokens: self.on_tokens,
                KvForgotten: self.on_forgotten, KvHoldings: self.on_holdings}

    def on_holdings(self, message: KvHoldings) -> None:
        """A store's report of the blocks it indexed and dropped (cache-aware routing)."""
        if self.holdings is None or message.stage not in self.keeps_kv or \
                not 0 <= message.replica < self.pipeline.stages[message.stage].replicas:
            return
        if not self.holdings.apply(message.stage, message.replica, message.seq, message.full, message.added,
                                   message.removed):
            self.log.debug("kv.holdings.resync", stage=message.stage, replica=message.replica, seq=message.seq)

    async def on_tokens(self, message: Tokens) -> None:
        pending: PendingRequest = self.requests.get(message.request_id)
        admitted = pending.admitted
        if pending.text is None or pending.text.request_id != message.request_id:
            pending.text = TextStream(admitted.request_id, self.tokenizer, admitted.stop, admitted.skip_special_tokens,
                                      admitted.resume_ids, admitted.resume_chars)
        deltas, stop = pending.text.add(message)
        if stop:
            self.spawn(self.send_output("stop", pending.route, StopRequest(message.request_id)))
        for delta in deltas:
            self.on_result(delta)

    def on_result(self, message: TextDelta | RequestFailed) -> None:
        pending: PendingRequest = self.requests.get(message.request_id)
        if isinstance(message, RequestFailed):
            if self.may_migrate(pending):
                self.spawn(self.failed_or_migrated(pending, message))
                return
        else:
            pending.generated.extend(message.token_ids)
            pending.sent_chars += len(message.text)
            if pending.attempts == 0:
                pending.cached_tokens = max(pending.cached_tokens, message.cached_tokens)
            pending.drafts = max(pending.drafts, (message.draft_proposed, message.draft_accepted))
            self.metrics.tokens_arrived(pending, message.completion_tokens)
        pending.queue.put_nowait(message)

    # --- submitting and cancelling ---------------------------------------------------------

    def _route(self, request_id: str, prompt_ids: list[int]) -> Route:
        request = RoutingRequest(request_id, prompt_ids)
        picked, fetch_from = {"ingress": self.replica}, {}
        ids = self.hasher.ids(prompt_ids) if self.holdings is not None else None
        for name in self.route_order:
            routable = self._on_paired_hosts(name, self._routable(name), picked)
            replicas = [
                ReplicaStatus(i, routable[i], self.reported.get((name, i), 0), self.assigned[(name, i)],
                              *self._cached_tokens(name, i, ids))
                for i in range(self.pipeline.stages[name].replicas)
            ]
            try:
                picked[name] = self.router.route(name, request, replicas)
            except NoReplicaAvailable:
                if self.holdings is not None:
                    self.holdings.settle(request_id)
                display = self.pipeline.stages[name].display_name
                raise ApiError(f"no {display} replica is up (restarting); retry shortly", status=503,
                               type="server_error") from None
            if ids is not None and name in self.keeps_kv:
                self.holdings.expect(request_id, name, picked[name], ids)  # its prompt's blocks go there
                healthy = [r for r in replicas if r.healthy]
                peer = self.router.fetch_from(name, request, picked[name], healthy)
                if peer is not None and peer != picked[name] and any(r.replica == peer for r in healthy):
                    fetch_from[name] = peer  # (a router's answer that is not another healthy replica: none)
        return Route(picked, fetch_from)

    def _routable(self, stage: str) -> list[bool]:
        return [(stage, i) not in self.down and (stage, i) not in self.unrouted
                for i in range(self.pipeline.stages[stage].replicas)]

    def _on_paired_hosts(self, stage: str, routable: list[bool], picked: dict[str, int]) -> list[bool]:
        """``routable`` narrowed by host locality (:mod:`pdflow.routing.locality`): a store only
        where one of its producers is up, a producer only on its store's host."""
        for pair in self.pairings:
            if stage == pair.store:
                up = {host for host, ok in zip(self.hosts_of[pair.producer], self._routable(pair.producer)) if ok}
                routable = locality.restrict(routable, self.hosts_of[stage], up, pair.strict)
            elif stage == pair.producer and pair.store in picked:
                store_host = self.pipeline.host_name_of(pair.store, picked[pair.store])
                routable = locality.restrict(routable, self.hosts_of[stage], {store_host}, pair.strict)
        return routable

    def _cached_tokens(self, stage: str, replica: int, ids: list[int] | None) -> tuple[int | None, int | None]:
        """Tokens of the prompt (block ``ids``) whose KV ``replica`` of ``stage`` holds or is
        computing, and of those the ones it said it holds; None where it is not a store, or has
        not said (or the router does not ask)."""
        if ids is None or stage not in self.keeps_kv or not self.holdings.known(stage, replica):
            return None, None
        bt = self.hasher.block_tokens
        return (self.holdings.prefix_blocks(stage, replica, ids) * bt,
                self.holdings.prefix_blocks(stage, replica, ids, coming=False) * bt)

    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...],
        skip_special_tokens: bool, *, kv_ttl_s: float | None = None, route: Route | None = None,
    ) -> PendingRequest:
        """Admit one request (``route``: the replicas it goes through; None: the router picks:
        the choices of an ``n > 1`` request share the first's, whose store holds the prompt's KV)."""
        if not self.accepting:
            raise ApiError("the server is shutting down", status=503, type="server_error")
        if len(self.requests) >= self.limits.max_queued_requests:
            raise ApiError(
                f"too many requests in flight (max_queued_requests={self.limits.max_queued_requests}); retry later",
                status=429, type="rate_limit_error",
            )
        route = route or self._route(request_id, prompt_ids)
        submission = Submission(request_id, prompt_ids, params, stop, skip_special_tokens, route, kv_ttl_s=kv_ttl_s,
                                speculating=self.pipeline.speculative.enabled)
        pending = PendingRequest(request_id, route, len(prompt_ids), submission=submission, internal_id=request_id)
        self.requests.open(request_id, pending)
        self.assigned.update(route.replicas.items())
        try:
            await self.admit(submission)
        except BaseException as exc:  # whatever it is, the request holds no slot after it
            self.cancel_request(pending, "failed to submit")
            if isinstance(exc, Exception):
                self.log.exception("request.submit_failed", request_id=request_id)
                raise ApiError(f"the request could not be handed to the pipeline: {exc!r}", status=503,
                               type="server_error") from exc
            raise
        return pending

    async def admit(self, submission: Submission) -> None:
        """Tell every stage on its route what it needs of ``submission``, downstream first: each
        stage knows the request before its upstream produces for it (they cope with any order)."""
        pending = self.requests.get(submission.request_id)
        if pending is not None:
            pending.admitted = submission
        for name, cls in self.admitted_by:
            message = cls.admission(submission, name)
            if message is not None:
                await self.bus.send(name, submission.route.of(name), message)

    async def _reap_loop(self) -> None:
        """The safety net under every path that counts a request in flight: a request still held
        well past its deadline (its HTTP handler gone without releasing it) is failed and freed."""
        grace = 5.0
        while True:
            await asyncio.sleep(1.0)
            overdue = time.monotonic() - self.limits.request_timeout_s - grace
            for pending in [p for p in self.requests.active.values() if p.received < overdue]:
                self.log.warning("request.reaped", request_id=pending.request_id)
                pending.queue.put_nowait(RequestFailed(pending.request_id, "ingress", "request timed out"))
                self.cancel_request(pending, "overdue")

    def _forget(self, pending: PendingRequest) -> bool:
        """Out of the table, its replicas' counts down; False if it was already gone."""
        if self.requests.end(pending.internal_id) is None:
            return False
        self.assigned.subtract(pending.route.replicas.items())
        if self.holdings is not None:
            self.holdings.settle(pending.internal_id)
        return True

    def finish(self, pending: PendingRequest, timeline: dict | None = None, finish_reason: str | None = None) -> None:
        if self._forget(pending):
            self.metrics.finished(pending, timeline, finish_reason, self._one_clock(pending.route))
        if timeline:
            self.timelines[pending.request_id] = timeline
            while len(self.timelines) > _TIMELINES_KEPT:
                self.timelines.popitem(last=False)

    def _one_clock(self, route) -> bool:
        """Whether every replica on ``route`` runs on one machine (their timeline marks compare)."""
        if not self.pipeline.multi_host:
            return True
        return len({self.pipeline.host_name_of(name, route.of(name)) for name in self.routed}) <= 1

    def cancel_request(self, pending: PendingRequest, reason: str) -> None:
        """Forget the request here and tell every stage on its route to free what it holds."""
        pending.abandoned = True
        if not self._forget(pending):
            return
        self.metrics.ended(reason)
        self.log.info("request.cancelled", request_id=pending.request_id, reason=reason)
        message = Cancel(pending.internal_id, reason)
        for name in self.routed:
            self.spawn(self.bus.send(name, pending.route.of(name), message))

    # --- stages going down and up ------------------------------------------------------------

    def on_stage_down(self, message: StageDown) -> None:
        self.down.add((message.stage, message.replica))
        if self.holdings is not None:
            self.holdings.forget(message.stage, message.replica)  # it says again when it is back
        if message.stage not in self.routed:
            return
        for pending in list(self.requests.active.values()):
            if pending.route.of(message.stage) == message.replica and not pending.migrating:
                error = f"{message.stage} replica {message.replica} failed: {message.reason}"
                if self.may_migrate(pending):
                    self.spawn(self.migrate(pending, error))
                    continue
                pending.queue.put_nowait(RequestFailed(pending.request_id, message.stage, error))
                self.cancel_request(pending, "stage down")

    def on_stage_up(self, message: StageUp) -> None:
        self.down.discard((message.stage, message.replica))

    def on_stage_status(self, message: StageStatus) -> None:
        stage = self.pipeline.stages.get(message.stage)
        if stage is None:
            return
        self.reported[(message.stage, message.replica)] = message.in_flight
        if message.state in UNROUTED_STATES:
            self.unrouted.add((message.stage, message.replica))
        else:
            self.unrouted.discard((message.stage, message.replica))
        self.stage_status[f"{stage.display_name}-{message.replica}"] = {
            "state": message.state, "pid": message.pid, "in_flight": message.in_flight,
            "restarts": message.restarts, "heartbeat": message.heartbeat,
            **({"stats": message.stats} if message.stats else {}),
            **({"notes": message.notes} if message.notes else {}),
        }

    # --- shutting down ----------------------------------------------------------------------

    def request_stop(self) -> None:
        if self.server is None:  # stopped before it served: nothing to drain
            self.stopping.set()
        elif self.accepting:
            self.accepting = False
            self.spawn(self._drain())

    async def _drain(self) -> None:
        """Take no new requests; give the in-flight ones ``shutdown_grace_s``, then fail them."""
        self.log.info("ingress.draining", in_flight=len(self.requests))
        deadline = time.monotonic() + self.limits.shutdown_grace_s
        while self.requests.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for pending in list(self.requests.active.values()):
            pending.queue.put_nowait(RequestFailed(pending.request_id, "ingress", "the server is shutting down"))
            self.cancel_request(pending, "shutdown")
        await asyncio.sleep(0.1)  # let the error responses go out
        self.server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.server_task), 2.0)
        self.stopping.set()
