"""prefill: runs each prompt through the model and streams every layer's KV the moment it exists.

kv-shuttle's :class:`KvPlan` says how much of the prompt the store holds already: that prefix's
KV comes to a buffer prefill registers (layer by layer: layer *l* computes as soon as its own
prefix is in) and only the rest is computed. The forward pass runs in a worker thread; each
layer's new keys and values are queued to the event loop, which writes them straight into their
blocks in the store's arena over the data plane while the next layers compute. The first token
goes to output ``tokens`` (ingress, or an egress stage); output ``done`` (decode) learns it from :class:`PrefillDone`
— unless the request ended here meanwhile (cancelled), then nothing more is sent for it.

Where the data plane shares memory with kv-shuttle (shm: :meth:`Transport.peer_memory`) and
``kv.zero_copy`` is on, the arena is mapped here: each layer's keys and values are computed
straight into their blocks (the compact engine's rotary step writes the keys there, the values
are gathered there out of the fused projection), a cached prefix is read where it is, and the
writes that follow only ring the doorbell: no KV byte is copied between the forward pass and the
store. A cancelled request's forward pass stops at its next layer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch

from pdflow import transports
from pdflow.engine import SamplerFactory, load_model, prefill
from pdflow.engine.llama import CompactLlama
from pdflow.engine.stopping import finish_reason
from pdflow.kv.arena import ArenaLayout, runs
from pdflow.kv.chunks import between_slots, into_slots, tokens_of_run
from pdflow.kv.layout import KEYS, VALUES, torch_dtype
from pdflow.messages import KvPlan, PlanWanted, PrefillDone, PrefillRequest, PrefixDestination, Tokens
from pdflow.runtime.stage import Stage, Submission
from pdflow.stages.engine_thread import engine_thread, run_in
from pdflow.transports.staging import Stager


class PrefixUnavailable(RuntimeError):
    """The cached prefix's KV did not arrive (the request was cancelled, or it timed out)."""


_SPARE_MAX_BYTES = 1 << 30  # a larger prefix's buffer is not kept between requests


@dataclass(slots=True, eq=False)
class _Prefix:
    """A cached prefix landing here: a buffer of ``tokens`` tokens, and which layers are complete."""

    region: int
    memory: memoryview  # the region's memory (``buffer`` is its first bytes)
    buffer: torch.Tensor
    tokens: int
    left: list[int]  # per layer: tokens (keys and values counted apart) still to land
    ready: list[threading.Event]
    landed: list[float]  # per layer: when its last chunk landed (0 until then)
    error: str | None = None


@dataclass(slots=True, eq=False)
class _InArena:
    """The store's arena, mapped here: ``memory`` (its bytes) and ``blocks`` (the same memory as
    ``(layers, 2, slots, block_tokens, kv_heads, head_dim)``)."""

    layout: ArenaLayout
    memory: memoryview
    blocks: torch.Tensor


@dataclass(slots=True, eq=False)
class _Job:
    request: PrefillRequest
    plan: asyncio.Future  # the KvPlan kv-shuttle sends
    cancelled: bool = False
    send_start: float | None = None  # when its first KV write began
    prefix: _Prefix | None = None
    queued: float = field(default_factory=time.monotonic)  # when it came
    dequeued: float = 0.0  # when prefill got to it
    plan_in: float = 0.0  # when its plan was there (after dequeued: prefill waited for the store)

    @property
    def route(self):
        return self.request.route


class PrefillStage(Stage):
    kind = "prefill"
    # kv: the stage whose store the KV is written into (over the data-plane link to it)
    outputs = {"tokens": "ingress", "done": "decode", "kv": "kv_shuttle"}
    opens = (PrefillRequest,)
    receives_kv = True  # cached prefixes
    computes_kv = True

    @classmethod
    def admission(cls, submission: Submission, name: str) -> PrefillRequest:
        return PrefillRequest(submission.request_id, submission.prompt_ids, submission.sampling, submission.route)

    async def setup(self) -> None:
        topo, cfg = self.pipeline, self.config
        self.executor = engine_thread("prefill-forward")
        self.model = await run_in(self.executor, load_model, self.ctx.model_dir, topo.model.dtype, cfg.device,
                                  topo.model.weights)
        self.model.max_context = topo.model.context(self.model.max_context)  # (model.max_model_len)
        self.samplers = SamplerFactory(self.model.eos_token_ids, self.model.vocab_size, self.ctx.model_dir)
        self.to_shuttle = self.kv_sender("kv")
        # kv.direct: KV also straight into decode's pool, over the store's link to decode
        self.to_decode = self._direct_sender() if topo.kv.direct else None
        # KV computed in device memory goes to the store's host arena through pinned buffers,
        # copied on a stream and a thread of their own (the loop and the forward never wait)
        self.stager = Stager()
        self.on_device = torch.device(self.model.device).type != "cpu"
        # KV computed in the store's blocks needs the compact engine's forward on the CPU
        self.store_codec = topo.kv.store_codec()  # the store keeps blocks encoded: no computing into them
        self.in_place = topo.kv.zero_copy and self.store_codec is None and \
            isinstance(self.model.model, CompactLlama) and torch.device(self.model.device).type == "cpu"
        self.from_shuttle = self.kv_receiver("kv")
        await self.from_shuttle.start()
        self.plan_on_demand = topo.kv.disk_path is not None and not topo.kv.prefetch
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.by_region: dict[int, _Job] = {}
        self._next_region = 0
        # the region of the last prefix that landed whole, kept for the next with its pages mapped:
        # a fresh buffer costs a page fault per 4 KiB as the KV lands (~0.2 s for 4K tokens here)
        self._spare: tuple[int, memoryview] | None = None
        self.spawn(self._worker(), essential=True)
        self.spawn(self._notice_loop(), essential=True)

    def _direct_sender(self):
        """A data-plane sender into decode's pool: the transport, options and codec of the link
        from the store to decode, whose receiver it writes to."""
        from pdflow.kv.coded import CodedTransport

        link = self.pipeline.link(self.output("kv"), self.output("done"))
        transport = transports.create(link.transport, host=self.config.bind_host_of(self.replica), **link.options)
        transport.authenticate(self.data_key)
        return CodedTransport(transport, link.make_codec(), self.pipeline.kv.block_tokens)

    async def teardown(self) -> None:
        if self.to_decode is not None:
            await self.to_decode.aclose()
        await self.to_shuttle.aclose()
        await self.from_shuttle.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.stager.close()

    def handlers(self):
        return {PrefillRequest: self.on_request, KvPlan: self.on_plan}

    def stats(self) -> dict[str, int]:
        staged = {"staged_bytes": self.stager.copied_bytes, "staging_waits": self.stager.pool.waits} \
            if self.on_device else {}
        waiting = self.queue.qsize()  # (one job at a time: the rest it holds is the one it runs)
        return {**self.copy_stats(self.to_shuttle), **self.codec_stats(self.to_shuttle, self.from_shuttle),
                **self.sent_stats(kv=self.to_shuttle, done=self.to_decode), **staged, "requests_waiting": waiting,
                "requests_running": max(len(self.requests) - waiting, 0)}

    def on_request(self, message: PrefillRequest) -> None:
        job = _Job(message, asyncio.get_running_loop().create_future())
        self.queue.put_nowait(self.requests.open(message.request_id, job))

    def on_plan(self, message: KvPlan) -> None:
        job: _Job = self.requests.get(message.request_id)
        if not job.plan.done():
            job.plan.set_result(message)

    def on_cancel(self, request_id: str, job: _Job, reason: str) -> None:
        job.cancelled = True
        job.plan.cancel()
        if job.prefix is not None:  # a forward thread waiting for it gives up (the buffer goes after it)
            job.prefix.error = job.prefix.error or "the request was cancelled"
            for event in job.prefix.ready:
                event.set()

    async def _worker(self) -> None:
        while True:
            job = await self.queue.get()
            if job.cancelled:
                continue
            job.dequeued = time.monotonic()
            try:
                if self.plan_on_demand or not job.plan.done():  # the store may be waiting to hear it
                    await self.send_output("kv", job.route, PlanWanted(job.request.request_id))
                await self._prefill(job)
            except PrefixUnavailable as exc:
                if not job.cancelled:
                    await self.fail(job.request.request_id, f"prefill failed: {exc}", job.route)
            except Exception as exc:
                self.log.exception("prefill.failed", request_id=job.request.request_id)
                await self.fail(job.request.request_id, f"prefill failed: {exc}", job.route)
            finally:
                self._drop_prefix(job)
                self.finish(job.request.request_id)

    # --- the cached prefix, arriving -----------------------------------------------------------

    async def _receive_prefix(self, job: _Job, plan: KvPlan) -> _Prefix:
        layout = self.model.layout
        n = plan.cached_tokens
        need = layout.request_bytes(n)
        if self._spare is not None and self._spare[1].nbytes >= need:
            (region, memory), self._spare = self._spare, None
        else:
            region = self._next_region
            self._next_region += 1
            memory = self.from_shuttle.allocate(region, need)
        buffer = torch.frombuffer(memory, dtype=torch.uint8, count=need)
        prefix = _Prefix(region, memory, buffer, n, [2 * n] * layout.num_layers,
                         [threading.Event() for _ in range(layout.num_layers)], [0.0] * layout.num_layers)
        job.prefix = prefix
        self.by_region[region] = job
        address = self.from_shuttle.address_for(region)
        await self.send_output("kv", job.route, PrefixDestination(job.request.request_id, address, region))
        return prefix

    async def _notice_loop(self) -> None:
        async for notice in self.notices(self.from_shuttle):
            job = self.by_region.get(notice.header.region)
            if job is None or job.prefix is None:
                continue
            prefix, layer = job.prefix, notice.header.layer
            if notice.error is not None:
                prefix.error = f"a chunk of the cached prefix was lost: {notice.error!r}"
                for event in prefix.ready:
                    event.set()
                continue
            prefix.left[layer] -= tokens_of_run(notice.header)
            if prefix.left[layer] <= 0:
                prefix.landed[layer] = time.monotonic()
                prefix.ready[layer].set()

    def _past(self, job: _Job, prefix: _Prefix):
        """What the forward thread calls for layer *l*'s prefix: waits until it is here."""
        layout, dtype = self.model.layout, torch_dtype(self.model.layout.dtype)
        timeout = self.limits.request_timeout_s

        def past(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not prefix.ready[layer].wait(timeout):
                raise PrefixUnavailable(f"layer {layer} of the cached prefix did not arrive within {timeout} s")
            if prefix.error is not None or job.cancelled:
                raise PrefixUnavailable(prefix.error or "the request was cancelled")
            out = []
            for kind in (0, 1):
                start = layout.offset(prefix.tokens, layer, kind)
                raw = prefix.buffer[start : start + layout.block_bytes(prefix.tokens)]
                out.append(raw.view(dtype).view(layout.shape(prefix.tokens)).to(self.model.device))
            return out[0], out[1]

        return past

    # --- computing in the store's own blocks ----------------------------------------------------

    async def _arena(self, job: _Job, plan: KvPlan) -> _InArena | None:
        """The store's arena mapped here, where prefill computes in place (see the module doc);
        None where it does not (the KV is then written with a copy)."""
        bt, n = self.pipeline.kv.block_tokens, len(job.request.prompt_ids)
        if not self.in_place or len(plan.prefix_slots) * bt != plan.cached_tokens or \
                len(plan.slots) * bt < n - plan.cached_tokens or \
                not all(0 <= slot < plan.num_slots for slot in plan.prefix_slots + plan.slots):
            return None  # (a plan that does not fit is written with a copy: the store's receiver refuses it)
        try:
            memory = await self.to_shuttle.peer_memory(plan.address, plan.region)
        except transports.TransportError as exc:
            self.log.warning("kv.arena.unmapped", request_id=job.request.request_id, error=repr(exc))
            return None  # the writes will say what is wrong
        layout = ArenaLayout(self.model.layout, bt, plan.num_slots)
        if memory is None or memory.nbytes < layout.nbytes:
            return None
        return _InArena(layout, memory, layout.view(torch.frombuffer(memory, dtype=torch.uint8, count=layout.nbytes)))

    def _targets(self, job: _Job, plan: KvPlan, arena: _InArena):
        """What the forward thread calls for layer *l*: where its keys and values go (the
        request's new blocks in the arena); raises once the request is cancelled."""
        kv, n, first = arena.layout.kv, len(job.request.prompt_ids), plan.cached_tokens
        spans = [(run.token_start - first, run.token_end - first, run.slot, run.count)
                 for run in runs(plan.slots, first, n, arena.layout.block_tokens)]

        def targets(layer: int):
            if job.cancelled:
                raise PrefixUnavailable("the request was cancelled")
            out = []
            for a, b, slot, count in spans:
                keys, values = (arena.blocks[layer, kind, slot : slot + count].view(-1, kv.num_kv_heads, kv.head_dim)
                                [: b - a] for kind in (KEYS, VALUES))
                out.append((a, b, keys, values))
            return out

        return targets

    def _attended(self, job: _Job, plan: KvPlan, arena: _InArena):
        """Layer *l*'s keys and values of the whole prompt, the cached prefix (which the lease
        holds) and the new tokens (written by then): where they are when the request's slots are
        consecutive, else gathered once."""
        kv, n, table = arena.layout.kv, len(job.request.prompt_ids), plan.prefix_slots + plan.slots
        first, count = table[0], len(table)
        consecutive = table == list(range(first, first + count))
        index = None if consecutive else torch.tensor(table)

        def attended(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = []
            for kind in (KEYS, VALUES):
                blocks = arena.blocks[layer, kind]
                blocks = blocks[first : first + count] if consecutive else blocks.index_select(0, index)
                out.append(blocks.view(-1, kv.num_kv_heads, kv.head_dim)[:n])
            return out[0], out[1]

        return attended

    def _drop_prefix(self, job: _Job) -> None:
        """Stop receiving into the prefix's buffer (once no forward thread reads it)."""
        prefix = job.prefix
        if prefix is None:
            return
        job.prefix = None
        self.by_region.pop(prefix.region, None)
        # Kept for the next prefix only once every chunk landed: then nothing more can arrive for it
        # (after a failure or a cancel a chunk may still be on its way, so that region goes).
        whole = prefix.error is None and all(left <= 0 for left in prefix.left)
        if whole and prefix.memory.nbytes <= _SPARE_MAX_BYTES and \
                (self._spare is None or self._spare[1].nbytes < prefix.memory.nbytes):
            if self._spare is not None:
                self.from_shuttle.unregister(self._spare[0])
            self._spare = (prefix.region, prefix.memory)
        else:
            self.from_shuttle.unregister(prefix.region)

    # --- computing and sending ----------------------------------------------------------------

    async def _prefill(self, job: _Job) -> None:
        request = job.request
        loop = asyncio.get_running_loop()
        timeout = self.limits.request_timeout_s
        try:
            plan: KvPlan = await asyncio.wait_for(asyncio.shield(job.plan), timeout)
        except asyncio.CancelledError:
            return  # cancelled
        except asyncio.TimeoutError:
            raise PrefixUnavailable(f"kv-shuttle gave no plan within {timeout} s") from None
        job.plan_in = time.monotonic()
        arena = await self._arena(job, plan)
        past = targets = attended = None
        if arena is not None:
            targets, attended = self._targets(job, plan, arena), self._attended(job, plan, arena)
        elif plan.cached_tokens:
            past = self._past(job, await self._receive_prefix(job, plan))
        layers: asyncio.Queue = asyncio.Queue()

        def sink(layer, keys, values) -> None:  # on the forward thread
            ready = None
            if keys.is_cuda:  # the staging copy starts once the layer (and this gather) is computed
                keys, values = keys.contiguous(), values.contiguous()
                ready = torch.cuda.current_stream(keys.device).record_event()
            loop.call_soon_threadsafe(layers.put_nowait, (layer, keys, values, ready))

        computed = asyncio.Event()
        sender = asyncio.ensure_future(self._send_layers(job, plan, layers, computed, arena))
        try:  # (a guide's first compile takes a second: off the event loop)
            sampler = await loop.run_in_executor(self.executor, self.samplers.make, request.sampling,
                                                 request.prompt_ids) if request.sampling.guide \
                else self.samplers.make(request.sampling, request.prompt_ids)
            result = await loop.run_in_executor(self.executor, prefill, self.model, request.prompt_ids, sampler,
                                                sink, past, plan.cached_tokens, targets, attended)
        except BaseException:
            sender.cancel()
            raise
        computed.set()
        if job.cancelled:
            sender.cancel()
            return
        token = result.first_token
        n = len(request.prompt_ids)
        reason = finish_reason(token, 1, n + 1, request.sampling, self.model.eos_token_ids, self.model.max_context)
        compute = {"prefill.start": [result.started], "prefill.layer_done": result.layer_done,
                   "prefill.end": [result.finished], "prefill.queued": [job.queued], "prefill.dequeued": [job.dequeued],
                   "prefill.plan_in": [job.plan_in]}
        if job.prefix is not None:
            compute["prefill.prefix_in"] = list(job.prefix.landed)
        # a request that ends here gets its (prefill-only) timeline with its only token
        first = Tokens(request.request_id, 0, [token], reason, compute if reason is not None else {},
                       plan.cached_tokens, logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs)
        await self.send_output("tokens", request.route, first)
        self.log.info("prefill.done", request_id=request.request_id, tokens=n, cached=plan.cached_tokens,
                      seconds=round(result.finished - result.started, 4))
        sent = await sender
        if sent is None or job.cancelled:
            return  # cancelled, or failed and reported
        timeline = {**compute, "prefill.send_start": [job.send_start or result.started], "prefill.layer_sent": sent}
        await self.send_output("done", request.route, PrefillDone(request.request_id, token, reason is not None, timeline))

    async def _send_layers(self, job: _Job, plan: KvPlan, layers: asyncio.Queue, computed: asyncio.Event,
                           in_arena: _InArena | None) -> list[float] | None:
        """Write each layer's new keys and values into their blocks in the store's arena as they
        come (with ``kv_streaming = "request"``: only once the whole prefill is computed); where
        they were computed in those blocks, the writes copy nothing and only say so."""
        rid = job.request.request_id
        layout = self.model.layout
        arena = ArenaLayout(layout, self.pipeline.kv.block_tokens, plan.num_slots, self.store_codec)
        n, table = len(job.request.prompt_ids), plan.prefix_slots + plan.slots
        direct = plan.direct if self.to_decode is not None and plan.cached_tokens == 0 else None
        if direct is not None:
            pool = ArenaLayout(layout, self.pipeline.kv.block_tokens, direct.num_slots)
            pool_slots = direct.slots[: -(-n // pool.block_tokens)]
        sent: list[float] = []
        target = "kv-shuttle"  # where the writes go now (what a failure names)
        try:
            if self.pipeline.engine.kv_streaming == "request":
                await computed.wait()
            job.send_start = time.monotonic()
            for _ in range(layout.num_layers):
                layer, keys, values, ready = await layers.get()
                if job.cancelled:
                    return None
                # from device memory through a staging buffer, held until the writes are done
                # (host memory: the tensors as they are)
                async with self.stager.to_host([keys, values], ready) as (keys, values):
                    if direct is not None:  # into decode's pool first: the store's copy goes behind it
                        into_pool = between_slots(rid, arena, in_arena.memory, layer, (KEYS, VALUES), plan.slots, 0, n,
                                                  pool, pool_slots, direct.region) if in_arena is not None else \
                            into_slots(rid, pool, direct.region, layer, keys, values, pool_slots, 0)
                        target = "decode"
                        for header, data in into_pool:
                            await self.to_decode.write(direct.address, header, data)
                        target = "kv-shuttle"
                    if in_arena is not None:  # from where they are: the writes copy nothing
                        chunks = between_slots(rid, arena, in_arena.memory, layer, (KEYS, VALUES), plan.slots,
                                               plan.cached_tokens, n, arena, table, plan.region)
                    else:
                        chunks = into_slots(rid, arena, plan.region, layer, keys, values, plan.slots,
                                            plan.cached_tokens)
                    for header, data in chunks:
                        await self.to_shuttle.write(plan.address, header, data)
                sent.append(time.monotonic())
            return sent
        except asyncio.CancelledError:
            return None
        except transports.TransportError as exc:
            self.log.error("kv.send.failed", request_id=rid, error=repr(exc))
            await self.fail(rid, f"KV transfer to {target} failed: {exc!r}", job.route, transient=True)
            return None
