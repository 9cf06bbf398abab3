"""worker: the colocated baseline. One process prefills and decodes, with continuous batching.

Each iteration does prefill work, then one decode step for the running batch:

- ``chunked_prefill_tokens = 0``: every waiting prompt is prefilled whole before the next step
  (prefill first, as engines without chunked prefill schedule it), so a long prompt stalls
  every running request for its whole prefill;
- ``chunked_prefill_tokens = N``: at most N prompt tokens of prefill per iteration, so a step
  waits for one chunk at most (chunks run as their own forward pass, then the decode step).

With ``kv.prefix_cache`` (the default) it keeps its own store (:mod:`pdflow.kv.local_cache`):
a prompt starts after its longest cached prefix, and its blocks, then its answer's, are kept.

Disaggregation is measured against this by changing only the topology file.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from pdflow.engine import DecodeBatch, SamplerFactory, Sequence, load_model
from pdflow.engine.chunked import ChunkedPrefill
from pdflow.engine.stopping import finish_reason
from pdflow.kv.blocks import BlockHasher, answer_blocks
from pdflow.kv.local_cache import LocalPrefixCache
from pdflow.messages import KvForget, KvForgotten, PrefillRequest, Route, StopRequest, Tokens
from pdflow.runtime.stage import Stage, Submission
from pdflow.speculative import speculation_for
from pdflow.stages.engine_thread import engine_thread, run_in
from pdflow.stages.step_counts import CountsDecodeSteps
from pdflow.stages.step_tokens import SendsStepTokens


@dataclass(slots=True, eq=False)
class WorkerContext:
    """What the worker keeps for a sequence of its batch (``seq.context``)."""

    request: PrefillRequest
    timeline: dict  # its prefill's: queued, started, ended
    tokens: list[int]  # its output tokens so far (the last one was never fed back: it has no KV)
    finished: bool = False  # its last token came: its answer's KV goes into the cache as it leaves

    @property
    def route(self) -> Route:
        return self.request.route


class WorkerStage(SendsStepTokens, CountsDecodeSteps, Stage):
    kind = "worker"
    outputs = {"tokens": "ingress"}
    opens = (PrefillRequest,)
    holds_kv = True  # ingress's KvForget comes here

    @classmethod
    def admission(cls, submission: Submission, name: str) -> PrefillRequest:
        return PrefillRequest(submission.request_id, submission.prompt_ids, submission.sampling, submission.route,
                              submission.kv_ttl_s)

    async def setup(self) -> None:
        topo, cfg = self.topology, self.ctx.config
        self.executor = engine_thread("worker-step")
        self.model = await run_in(self.executor, load_model, self.ctx.model_dir, topo.model.dtype, cfg.device,
                                  topo.model.weights)
        self.model.max_context = topo.model.context(self.model.max_context)  # (model.max_model_len)
        self.samplers = SamplerFactory(self.model.eos_token_ids, self.model.vocab_size, self.ctx.model_dir)
        self.batch = DecodeBatch(self.model, self.limits.max_batch)
        self.batch.speculation = speculation_for(topo.speculative, self.model)
        kv = topo.kv
        self.cache = None
        if kv.prefix_cache:
            self.cache = LocalPrefixCache(self.model.layout, BlockHasher.for_pipeline(topo), kv.store_bytes,
                                          high_watermark=kv.high_watermark, low_watermark=kv.low_watermark,
                                          block_ttl_s=kv.block_ttl_s, codec=kv.store_codec())
        self.chunk = topo.engine.chunked_prefill_tokens
        self.waiting: deque[tuple[PrefillRequest, float]] = deque()
        self.prefilling: tuple[PrefillRequest, ChunkedPrefill, dict] | None = None
        self.running: dict[str, Sequence] = {}
        self.gone: set[str] = set()  # cancelled or stopped, not yet out of the batch
        self.wake = asyncio.Event()
        self.spawn(self._loop(), essential=True)

    async def teardown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def handlers(self):
        return {PrefillRequest: self.on_request, StopRequest: lambda m: self.cancel(m.request_id, "stop string matched"),
                KvForget: self.on_forget}

    async def on_forget(self, message: KvForget) -> None:
        memory = 0
        if self.cache is not None:
            memory = self.cache.forget(None if message.everything else message.prompt_ids)
        await self.bus.broadcast("ingress", KvForgotten(  # (the ingress that asked knows its id)
            message.forget_id, self.ctx.stage, self.replica, memory, 0))

    def stats(self) -> dict[str, int]:
        speculation = self.batch.speculation.stats() if self.batch.speculation is not None else {}
        queue = {"requests_waiting": len(self.waiting),
                 "requests_running": len(self.batch) + int(self.prefilling is not None)}
        return {**(self.cache.stats() if self.cache is not None else {}), **speculation, **self.batch_stats(), **queue}

    def on_request(self, message: PrefillRequest) -> None:
        self.requests.open(message.request_id, message)
        self.waiting.append((message, time.monotonic()))
        self.wake.set()

    def on_cancel(self, request_id: str, request: PrefillRequest, reason: str) -> None:
        self.gone.add(request_id)
        self.wake.set()

    # --- on the step thread -------------------------------------------------------------------

    def _prefill_work(self) -> list[tuple[PrefillRequest, int, ChunkedPrefill, dict]]:
        """Prefill what this iteration allows; returns the prompts that finished with their first token."""
        done = []
        budget = self.chunk or None  # None: no limit (whole prompts)
        while (budget is None or budget > 0) and len(self.batch) + len(done) < self.batch.max_batch:
            if self.prefilling is None:
                if not self.waiting:
                    break
                request, queued = self.waiting.popleft()
                if request.request_id in self.gone:
                    self.gone.discard(request.request_id)
                    continue
                started = time.monotonic()
                cached, past = 0, None
                if self.cache is not None and request.sampling.prompt_logprobs is None:  # (those need every position)
                    cached, past = self.cache.prefix(request.request_id, request.prompt_ids)
                sampler = self.samplers.make(request.sampling, request.prompt_ids)
                run = ChunkedPrefill(self.model, request.prompt_ids, sampler, past)
                self.prefilling = (request, run, {"worker.queued": [queued], "prefill.start": [started],
                                                  "cached": cached})
            request, run, timeline = self.prefilling
            before = run.remaining
            token = run.run(budget or run.remaining)
            if budget is not None:
                budget -= before - run.remaining
            if token is not None:
                timeline["prefill.end"] = [time.monotonic()]
                timeline["logprobs"] = run.sampler.take_logprobs()  # the first token's (before its first step)
                self._keep_prompt(request, run, timeline["cached"])
                done.append((request, token, run, timeline))
                self.prefilling = None
        return done

    def _keep_prompt(self, request: PrefillRequest, run: ChunkedPrefill, cached: int) -> None:
        if self.cache is None:
            return
        bt = self.cache.block_tokens
        end = len(request.prompt_ids) // bt * bt
        if end > cached:
            self.cache.keep(request.prompt_ids, cached // bt, *run.token_major(cached, end), keep_s=request.keep_s)

    def _keep_answer(self, seq: Sequence) -> None:
        """Before ``seq`` leaves the batch: its answer's full blocks into the store."""
        context: WorkerContext = seq.context
        request, output_ids = context.request, context.tokens[:-1]
        n, bt = len(request.prompt_ids), self.cache.block_tokens
        blocks = answer_blocks(n, n + len(output_ids), bt)
        if blocks:
            keys, values = self.batch.export(seq, blocks.start * bt, blocks.stop * bt)
            self.cache.keep(request.prompt_ids + output_ids, blocks.start, keys, values, keep_s=request.keep_s)

    def _iterate(self, remove: list[Sequence]):
        for seq in remove:
            if self.cache is not None and seq.context.finished:
                self._keep_answer(seq)
            self.batch.remove(seq)
        finished_prefills = self._prefill_work()
        joined = []
        for request, token, run, timeline in finished_prefills:
            n = len(request.prompt_ids)
            reason = finish_reason(token, 1, n + 1, request.sampling, self.model.eos_token_ids,
                                   self.model.max_context)
            if reason is None and request.request_id not in self.gone:
                history = [*request.prompt_ids, token] if self.batch.speculation is not None else None
                seq = Sequence(request.request_id, n, token, run.sampler, history=history,
                               context=WorkerContext(request, timeline, [token]))
                self.batch.add(seq, run.layer_kv)
                joined.append(seq)
            timeline["finish"] = reason
        return finished_prefills, joined, self.step_batch()

    # --- on the event loop ----------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self.waiting or self.prefilling or self.running):
                self.wake.clear()
                await self.wake.wait()
            remove = [self.running.pop(rid) for rid in list(self.gone) if rid in self.running]
            self.gone.difference_update(seq.request_id for seq in remove)
            prefilled, joined, results = await loop.run_in_executor(self.executor, self._iterate, remove)
            for request, token, run, timeline in prefilled:
                reason = timeline.pop("finish")
                cached = timeline.pop("cached")
                logprobs = timeline.pop("logprobs")
                if request.request_id in self.gone:
                    if request.request_id not in self.running:
                        self.gone.discard(request.request_id)
                    continue
                if reason is not None:
                    self.finish(request.request_id)
                first = Tokens(request.request_id, 0, [token], reason, cached_tokens=cached,
                               logprobs=logprobs, prompt_logprobs=run.prompt_logprobs)
                await self.send_output("tokens", request.route, first)
            for seq in joined:
                self.running[seq.request_id] = seq
            await self.send_step_tokens(results, self.gone)

    def last_token(self, seq: Sequence, now: float) -> dict:
        """``seq`` generated its last token: it is over here (its answer's KV is kept as it leaves)."""
        context: WorkerContext = seq.context
        context.finished = True
        self.finish(seq.request_id)
        return {**context.timeline, "decode.steps": seq.steps, "decode.end": [now]}
