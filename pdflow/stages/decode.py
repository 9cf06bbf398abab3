"""decode: receives each request's KV into memory it registered, then decodes it in a running batch.

Where pdflow's attention kernel runs (the compact engine in float32 on the CPU), that memory is
one pool of blocks in the store's layout (``[kv] decode_pool_bytes``): each request is given the
slots for its prompt and ``max_tokens`` when it arrives (it waits while they are not free), the
data plane lands its KV straight in them, and the batch attends from them in place
(:class:`~pdflow.engine.paged.PagedDecodeBatch`): joining and leaving copy nothing. On one host with
shm (``kv.zero_copy``, one kv-shuttle replica) decode goes further and keeps no pool of its own: it
maps the store's arena and attends from the request's blocks there (:class:`KvInPlace`, then
:class:`KvInStore` once the prompt's KV is all in), writing the answer's KV into the blocks the
store leased for it, where the store indexes it at the end. Elsewhere each
request gets a buffer of its own, copied into a row of a dense batch when it joins.

Requests join and leave the batch between steps (continuous batching). A request joins once
every token of every layer has landed (the cached prefix from the store, the rest from prefill
through kv-shuttle) and prefill has said which token comes first. Each step runs in a worker
thread; its tokens go to ingress (or an egress stage). When a request ends, kv-shuttle hears
which tokens decode generated (:class:`KvReleased`); if they complete blocks the store lacks, it
names slots for them (:class:`KvReturnSlots`) and decode writes that KV back, so the next turn of
a chat finds its history, answers included, in the store.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdflow import transports
from pdflow.engine import DecodeBatch, SamplerFactory, Sequence, load_model
from pdflow.engine.paged import KvPool, PagedDecodeBatch
from pdflow.kv.arena import ArenaLayout
from pdflow.kv.blocks import answer_blocks
from pdflow.kv.chunks import into_slots, slot_of, tokens_of_run
from pdflow.messages import (
    LATE_WRITES_S,
    DecodeRequest,
    KvDestination,
    KvInPlace,
    KvInStore,
    KvReleased,
    KvReturnSlots,
    PrefillDone,
    Route,
    StopRequest,
)
from pdflow.runtime.stage import Stage, Submission
from pdflow.speculative import speculation_for
from pdflow.stages.engine_thread import engine_thread, run_in
from pdflow.stages.step_counts import CountsDecodeSteps
from pdflow.stages.step_tokens import SendsStepTokens
from pdflow.transports.staging import Stager

_ANSWER_WAIT_S = 30.0  # how long a finished request waits for kv-shuttle's KvReturnSlots
POOL = 0  # the pool's region; requests' own buffers (no pool) are 1, 2, ...


@dataclass(slots=True, eq=False)
class _Incoming:
    """A request whose KV is still landing."""

    request: DecodeRequest
    buffer: torch.Tensor | None
    region: int
    tokens_left: int  # of every layer's keys and values
    layer_in: list[float]
    done: PrefillDone | None = None
    slots: list[int] | None = None  # in the pool: its blocks, until the batch owns them
    by_block: list[int] | None = None  # in the pool: the slot of each block of the prompt (-1: dropped), if not slots
    skipped: int = 0  # prompt tokens whose KV the link's codec drops (sink + window)
    pool: KvPool | None = None  # attending in the store: the store's arena, where its slots are
    created: float = field(default_factory=time.monotonic)
    answer: tuple[int, asyncio.Future] | None = None  # (first token, its KV from the batch) once finished

    @property
    def route(self):
        return self.request.route


@dataclass(slots=True, eq=False)
class DecodeContext:
    """What decode keeps for a sequence of its batch (``seq.context``)."""

    entry: _Incoming  # how it arrived (kept for its timeline and its answer)
    joined: float  # when it joined the batch
    tokens: list[int]  # its output tokens so far (the last one was never fed back: it has no KV)
    answer: tuple[int, int] | None = None  # tokens whose KV goes back to the store, copied before its row goes ...
    answer_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # ... into this, for the writer

    @property
    def route(self) -> Route:
        return self.entry.request.route


class DecodeStage(SendsStepTokens, CountsDecodeSteps, Stage):
    kind = "decode"
    outputs = {"tokens": "ingress", "destination": "kv_shuttle"}
    opens = (DecodeRequest,)
    receives_kv = True

    @classmethod
    def admission(cls, submission: Submission, name: str) -> DecodeRequest:
        return DecodeRequest(submission.request_id, len(submission.prompt_ids), submission.sampling, submission.route,
                             list(submission.prompt_ids) if submission.speculating or submission.sampling.reads_prompt
                             else [])

    async def setup(self) -> None:
        topo, cfg = self.pipeline, self.config
        self.executor = engine_thread("decode-step")
        self.model = await run_in(self.executor, load_model, self.ctx.model_dir, topo.model.dtype, cfg.device,
                                  topo.model.weights)
        self.model.max_context = topo.model.context(self.model.max_context)  # (model.max_model_len)
        self.samplers = SamplerFactory(self.model.eos_token_ids, self.model.vocab_size, self.ctx.model_dir)
        self.from_shuttle = self.kv_receiver("destination")
        await self.from_shuttle.start()
        self.to_shuttle = self.kv_sender("destination")
        self.stager = Stager()  # answers' KV from device memory: copied off the loop (host memory: as it is)
        self.block_tokens = topo.kv.block_tokens if topo.kv.prefix_cache else 0
        shuttle = self.output("destination")
        # how KV reaches decode: a codec that drops heads or tokens changes what decode attends with
        self.link_codec = topo.link(shuttle, self.ctx.stage).make_codec()
        self.dropped_tokens = 0  # prompt tokens whose KV the link's codec dropped, over all requests
        self.pool: KvPool | None = None
        self.store_pool: KvPool | None = None  # attending in the store: its arena, once mapped
        self.store_codec = topo.kv.store_codec()  # the store keeps blocks encoded: no attending from them
        self.in_place = (topo.kv.zero_copy and self.store_codec is None and PagedDecodeBatch.runs(self.model)
                         and self.to_shuttle.shares_memory
                         and topo.stages[shuttle].replicas == 1)
        if self.in_place:
            self.batch = PagedDecodeBatch(self.model, self.limits.max_batch, None)  # the pool comes with the KV
        elif PagedDecodeBatch.runs(self.model):
            arena = ArenaLayout.for_capacity(self.model.layout, topo.kv.block_tokens, topo.kv.decode_pool_bytes)
            self.pool = KvPool(arena, self.from_shuttle.allocate(POOL, arena.nbytes))  # with shm: a shared segment
            self.pool_address = self.from_shuttle.address_for(POOL)
            self.batch = PagedDecodeBatch(self.model, self.limits.max_batch, self.pool)
        else:
            self.batch = DecodeBatch(self.model, self.limits.max_batch)
        self._structural_setup()
        self.batch.speculation = speculation_for(topo.speculative, self.model)
        self.by_region: dict[int, _Incoming] = {}  # KV still landing in a buffer of its own
        self.awaiting_slots: deque[_Incoming] = deque()  # no free pool slots for them yet
        self.waiting: list[_Incoming] = []  # all KV here, not yet in the batch
        self.running: dict[str, Sequence] = {}
        self.to_remove: set[str] = set()
        self.wake = asyncio.Event()
        self._next_region = POOL + 1
        self.spawn(self._notice_loop(), essential=True)
        self.spawn(self._step_loop(), essential=True)

    def _structural_setup(self) -> None:
        """With a link codec that prunes kv heads, the batch attends with the kept heads only; one
        that drops prompt tokens needs the pool (a block table that skips them)."""
        codec, layout = self.link_codec, self.model.layout
        if not codec.structural:
            return
        codec.check_model(layout.num_layers, layout.num_kv_heads)
        masks = [codec.kept_heads(layer, layout.num_kv_heads) for layer in range(layout.num_layers)]
        if any(mask is not None for mask in masks):
            self.batch.kv_keep = torch.tensor([mask or [True] * layout.num_kv_heads for mask in masks],
                                              dtype=torch.uint8)
        if self.pool is None and codec.drops_tokens:
            raise RuntimeError(f"KV codec {codec.spec!r} drops prompt tokens, which decode can only attend without "
                               "from its pool of blocks (model.dtype float32, decode on the cpu, kv.zero_copy off "
                               "with shm)")
        self.log.info("kv.link_codec", codec=codec.spec, pruned_heads=sum(m.count(False) for m in masks if m))

    def _kept(self, request: DecodeRequest) -> list[int] | None:
        """The prompt's blocks that the link's codec sends (None: all of them)."""
        if self.pool is None or not self.link_codec.structural:
            return None
        bt = self.pool.block_tokens
        kept = self.link_codec.kept_blocks(request.prompt_len, bt)
        return None if len(kept) == self.pool.slots_for(request.prompt_len) else kept

    def _skipped(self, request: DecodeRequest) -> int:
        """Prompt tokens whose KV decode does not get (the link's codec drops them)."""
        kept = self._kept(request)
        if kept is None:
            return 0
        bt, n = self.pool.block_tokens, request.prompt_len
        return n - sum(min(bt, n - block * bt) for block in kept)

    async def teardown(self) -> None:
        await self.from_shuttle.aclose()
        await self.to_shuttle.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.stager.close()

    def handlers(self):
        return {
            DecodeRequest: self.on_request,
            PrefillDone: self.on_prefill_done,
            KvReturnSlots: self.on_return_slots,
            KvInStore: self.on_in_store,
            StopRequest: lambda m: self.cancel(m.request_id, "stop string matched"),
        }

    def stats(self) -> dict[str, int]:
        sent = {**self.copy_stats(self.to_shuttle), **self.codec_stats(self.from_shuttle, self.to_shuttle),
                **self.sent_stats(destination=self.to_shuttle), **self.batch_stats(),
                "requests_running": len(self.batch)}
        if self.link_codec.drops_tokens:
            sent["kv_prompt_tokens_dropped"] = self.dropped_tokens
        if self.batch.speculation is not None:
            sent.update(self.batch.speculation.stats())
        if self.pool is None:
            return {**sent, "attends_in_store": int(self.in_place), "requests_waiting": 0}
        return {**sent, "pool_blocks": self.pool.arena.num_slots, "pool_free_blocks": self.pool.free_slots,
                "awaiting_pool_blocks": len(self.awaiting_slots), "requests_waiting": len(self.awaiting_slots)}

    # --- KV arrival -------------------------------------------------------------------------

    async def on_request(self, message: DecodeRequest) -> None:
        if message.sampling.guide and not self.samplers.warm:  # the grammar engine's first load, off the step thread
            self.spawn(asyncio.to_thread(self.samplers.warm_up))
        if self.in_place:
            layout = self.model.layout
            entry = _Incoming(message, None, POOL, 2 * layout.num_layers * message.prompt_len, [0.0] * layout.num_layers)
            self.requests.open(message.request_id, entry)
            tokens = min(message.prompt_len + message.sampling.max_tokens, self.model.max_context)
            await self.send_output("destination", message.route, KvInPlace(message.request_id, tokens))
            return
        if self.pool is not None:
            await self._request_into_pool(message)
            return
        layout = self.model.layout
        nbytes = layout.request_bytes(message.prompt_len)
        region = self._next_region
        self._next_region += 1
        buffer = torch.frombuffer(self.from_shuttle.allocate(region, nbytes), dtype=torch.uint8)
        entry = _Incoming(message, buffer, region, 2 * layout.num_layers * message.prompt_len,
                          [0.0] * layout.num_layers)
        self.requests.open(message.request_id, entry)
        self.by_region[region] = entry
        destination = KvDestination(message.request_id, self.from_shuttle.address_for(region), region, nbytes)
        await self.send_output("destination", message.route, destination)

    def _blocks_for(self, request: DecodeRequest, pool: KvPool | None = None) -> int:
        """Pool blocks the request holds: its prompt (what of it the link's codec keeps) and every
        token it may generate."""
        tokens = min(request.prompt_len + request.sampling.max_tokens, self.model.max_context)
        return (pool or self.pool).slots_for(max(tokens, request.prompt_len) - self._skipped(request))

    async def on_in_store(self, message: KvInStore) -> None:
        """The request's KV is all in the store's blocks: attend from them there."""
        entry: _Incoming = self.requests.get(message.request_id)
        if not self.in_place or entry.pool is not None:
            return  # not asked for, or said already
        rid, layout = message.request_id, self.model.layout
        try:
            memory = await self.to_shuttle.peer_memory(message.address, message.region)
        except transports.TransportError as exc:
            memory, error = None, f"mapping the KV store's memory failed: {exc!r}"
        else:
            error = "the KV store's memory cannot be mapped here"
        arena = ArenaLayout(layout, self.pipeline.kv.block_tokens, message.num_slots)
        if memory is not None and memory.nbytes >= arena.nbytes:
            pool = self.store_pool
            if pool is None or pool.memory is not memory or pool.arena != arena:
                pool = self.store_pool = KvPool(arena, memory, owns_slots=False)
                self.log.info("kv.store.mapped", address=message.address, blocks=arena.num_slots, bytes=arena.nbytes)
            need = self._blocks_for(entry.request, pool)
            if len(message.slots) >= need and all(0 <= slot < arena.num_slots for slot in message.slots):
                if self.requests.get(rid) is entry:  # (not cancelled while mapping)
                    entry.pool, entry.slots, entry.tokens_left = pool, list(message.slots[:need]), 0
                    entry.layer_in = list(message.layer_in[: layout.num_layers]) or entry.layer_in
                    self._maybe_complete(entry)
                return
            error = f"the KV store named {len(message.slots)} blocks for a request that needs {need}"
        if self.requests.get(rid) is entry:
            await self.fail(rid, error, entry.request.route, transient=True)

    async def _request_into_pool(self, message: DecodeRequest) -> None:
        layout = self.model.layout
        skipped = self._skipped(message)
        entry = _Incoming(message, None, POOL, 2 * layout.num_layers * (message.prompt_len - skipped),
                          [0.0] * layout.num_layers, skipped=skipped)
        self.dropped_tokens += skipped
        self.requests.open(message.request_id, entry)
        need, held = self._blocks_for(message), self.pool.arena.num_slots
        if need > held:
            await self.fail(message.request_id, f"the request needs {need} KV blocks of {self.pool.block_tokens} "
                            f"tokens (its prompt and max_tokens) and decode's pool holds {held} "
                            "(kv.decode_pool_bytes); lower max_tokens or raise kv.decode_pool_bytes", message.route)
            return
        self.awaiting_slots.append(entry)
        self._grant_slots()

    def _grant_slots(self) -> None:
        """Give pool slots to the requests awaiting them, first come first served, while they fit,
        and tell kv-shuttle where each one's KV goes."""
        while self.awaiting_slots:
            entry = self.awaiting_slots[0]
            request = entry.request
            need = self._blocks_for(request)
            if need > self.pool.free_slots:
                return
            self.awaiting_slots.popleft()
            entry.slots = self.pool.take(need)
            kept = self._kept(request)
            if kept is not None:  # the dropped blocks' KV is not sent: no slot for them
                entry.by_block = [-1] * self.pool.slots_for(request.prompt_len)
                for slot, block in zip(entry.slots, kept):
                    entry.by_block[block] = slot
                entry.by_block += entry.slots[len(kept):]
            destination = KvDestination(request.request_id, self.pool_address, POOL, self.pool.arena.nbytes,
                                        entry.by_block or entry.slots, self.pool.arena.num_slots)
            self.spawn(self.send_output("destination", request.route, destination))

    def _give_back(self, entry: _Incoming) -> None:
        """The request's pool slots back, once nothing more can land in them."""
        slots, entry.slots = entry.slots, None
        if slots is None:
            return
        if entry.tokens_left <= 0:
            self.pool.give(slots)
            self._grant_slots()
        else:
            asyncio.get_running_loop().call_later(LATE_WRITES_S, self._late_give_back, slots)

    def _late_give_back(self, slots: list[int]) -> None:
        self.pool.give(slots)
        self._grant_slots()

    def _in_its_slots(self, entry: _Incoming, header) -> bool:
        """Did the chunk land in the request's own blocks (where its token range belongs)?"""
        if entry.slots is None or header.kind not in (0, 1) or not 0 <= header.layer < self.model.layout.num_layers:
            return False
        block = header.token_start // self.pool.block_tokens
        by_block = entry.by_block or entry.slots
        return 0 <= header.token_start < header.token_end and block < len(by_block) and \
            slot_of(self.pool.arena, header) == by_block[block] >= 0

    def on_prefill_done(self, message: PrefillDone) -> None:
        entry: _Incoming = self.requests.get(message.request_id)
        entry.done = message
        self._maybe_complete(entry)

    async def _notice_loop(self) -> None:
        async for notice in self.notices(self.from_shuttle):
            if notice.header.region == POOL and self.pool is not None:
                entry = self.requests.get(notice.header.request_id)
                if not isinstance(entry, _Incoming) or entry.slots is None:
                    continue  # over, or already in the batch
                if notice.error is None and not self._in_its_slots(entry, notice.header):
                    error = "a KV chunk for it landed outside its blocks of decode's pool"
                    await self.fail(entry.request.request_id, error, entry.request.route, transient=True)
                    continue
            else:
                entry = self.by_region.get(notice.header.region)
            if entry is None:
                continue
            if notice.error is not None:
                error = f"KV chunk lost on its way to decode: {notice.error!r}"
                await self.fail(entry.request.request_id, error, entry.request.route, transient=True)
                continue
            entry.tokens_left -= tokens_of_run(notice.header)
            layer = notice.header.layer
            entry.layer_in[layer] = max(entry.layer_in[layer], notice.received_at)
            self._maybe_complete(entry)

    def _maybe_complete(self, entry: _Incoming) -> None:
        if entry.tokens_left > 0 or entry.done is None:
            return
        self._release(entry)
        if entry.done.finished:
            if self.pool is not None:
                self._give_back(entry)
            self._end(entry)
        elif entry.buffer is not None and entry.buffer.device != torch.device(self.model.device):
            self.spawn(self._to_device(entry))
        else:
            self.waiting.append(entry)
            self.wake.set()

    async def _to_device(self, entry: _Incoming) -> None:
        """On a GPU: the request's KV copied from its receive buffer into device memory by the
        stager (its thread, its CUDA stream) before it joins, so the step thread never waits for it."""
        rid = entry.request.request_id
        host = entry.buffer
        try:
            device = torch.empty(host.shape, dtype=host.dtype, device=self.model.device)
            await self.stager.to_device([(device, host)])
        except Exception as exc:  # device memory ran out, or the device failed
            await self.fail(rid, f"copying the KV into device memory failed: {exc!r}", entry.request.route)
            return
        if self.requests.get(rid) is entry:  # (not cancelled meanwhile)
            entry.buffer = device
            self.waiting.append(entry)
            self.wake.set()

    def _release(self, entry: _Incoming) -> None:
        """The KV is all here (or lost): stop receiving into it."""
        if self.by_region.pop(entry.region, None) is not None:
            self.from_shuttle.unregister(entry.region)

    def _end(self, entry: _Incoming, output_ids: list[int] | None = None) -> None:
        """The request is over here: kv-shuttle hears it (with the tokens whose KV decode can give
        back, if any) and may drop its leases."""
        rid = entry.request.request_id
        self.spawn(self.send_output("destination", entry.request.route, KvReleased(rid, output_ids or [])))
        if entry.answer is None:
            self.finish(rid)

    def on_cancel(self, request_id: str, entry: _Incoming, reason: str) -> None:
        self._release(entry)
        if entry in self.awaiting_slots:
            self.awaiting_slots.remove(entry)
        if self.pool is not None:  # (slots that went with the batch are the batch's to give back)
            self._give_back(entry)
        # kv-shuttle drops the request's leases (a second KvReleased, while an answer was offered:
        # the answer is not coming)
        self.spawn(self.send_output("destination", entry.request.route, KvReleased(request_id)))
        if entry in self.waiting:
            self.waiting.remove(entry)
        if request_id in self.running:
            self.to_remove.add(request_id)
            self.wake.set()

    # --- the batch --------------------------------------------------------------------------

    def _admit(self, entries: list[tuple[_Incoming, list[int] | None]]) -> list[Sequence]:
        """On the step thread: each request joins the batch, with the pool slots its KV is in
        (nothing copied), or copied from its buffer into a row."""
        layout = self.model.layout
        admitted = []
        for entry, slots in entries:
            n = entry.request.prompt_len
            first = entry.done.first_token
            history = [*entry.request.prompt_ids, first] if self.batch.speculation is not None else None
            sampler = self.samplers.make(entry.request.sampling, entry.request.prompt_ids, [first])
            seq = Sequence(entry.request.request_id, n - entry.skipped, first, sampler, skipped=entry.skipped,
                           history=history)
            if slots is not None:
                self.batch.add(seq, slots)
            else:
                buffer = entry.buffer.to(self.model.device)
                self.batch.add(seq, lambda layer: layout.views(buffer, n, layer))
                entry.buffer = buffer = None  # the batch holds the KV now: free the receive buffer
            seq.context = DecodeContext(entry, time.monotonic(), [first])
            admitted.append(seq)
        return admitted

    def _step(self, admit: list[tuple[_Incoming, list[int] | None]],
              remove: list[Sequence]) -> tuple[list[Sequence], list]:
        for seq in remove:
            context: DecodeContext = seq.context
            if context.answer is not None:  # its KV goes back to the store: copy it before the row goes
                context.answer_kv = self.batch.export(seq, *context.answer)
            self.batch.remove(seq)
        admitted = self._admit(admit)
        return admitted, self.step_batch()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            room = self.limits.max_batch - len(self.running) + len(self.to_remove)
            if self.in_place:  # one batch attends in one arena: a new one (kv-shuttle restarted) once it is empty
                if not self.running and self.waiting and self.waiting[0].pool is not self.batch.pool:
                    self.batch.pool = self.waiting[0].pool
                fits = [entry for entry in self.waiting if entry.pool is self.batch.pool]
                joining = fits[:room]
                self.waiting = [entry for entry in self.waiting if entry not in joining]
            else:
                joining, self.waiting = self.waiting[:room], self.waiting[room:]
            admit = []
            for entry in joining:  # its slots are the batch's from here (a cancel meanwhile leaves them)
                admit.append((entry, entry.slots))
                entry.slots = None
            remove = [self.running.pop(rid) for rid in self.to_remove if rid in self.running]
            self.to_remove.clear()
            admitted, results = await loop.run_in_executor(self.executor, self._step, admit, remove)
            if remove and self.pool is not None:
                self._grant_slots()  # the removed sequences' slots are free
            for seq in remove:
                context: DecodeContext = seq.context
                if context.answer_kv is not None:
                    future = context.entry.answer[1]
                    if not future.done():
                        future.set_result(context.answer_kv)
                        context.answer_kv = None
            for seq in admitted:
                self.running[seq.request_id] = seq
                if seq.request_id not in self.requests:  # cancelled while it joined
                    self.to_remove.add(seq.request_id)
            await self.send_step_tokens(results, self.to_remove)

    def last_token(self, seq: Sequence, now: float) -> dict:
        """``seq`` generated its last token: its answer's KV is offered to the store; its timeline."""
        context: DecodeContext = seq.context
        entry = context.entry
        self._finished(seq, entry)
        timeline = dict(entry.done.timeline)
        timeline["decode.layer_in"] = entry.layer_in
        timeline["decode.joined"] = [context.joined]
        timeline["decode.steps"] = seq.steps
        timeline["decode.end"] = [now]
        return timeline

    # --- the answer's KV back into the store ------------------------------------------------------

    def _finished(self, seq: Sequence, entry: _Incoming) -> None:
        """``seq`` generated its last token: offer kv-shuttle the KV of its answer."""
        output_ids = seq.context.tokens[:-1]  # the last token was never fed back: it has no KV
        n = entry.request.prompt_len
        blocks = answer_blocks(n, n + len(output_ids), self.block_tokens) if self.block_tokens else range(0)
        if self.link_codec.structural:  # computed with heads or tokens missing: not the answer's own KV
            self._end(entry)
            return
        if not blocks or self.in_place:  # (in place: the store indexes the answer where it is)
            self._end(entry, output_ids)
            return
        bt = self.block_tokens
        seq.context.answer = (blocks.start * bt, blocks.stop * bt)
        entry.answer = (blocks.start * bt, asyncio.get_running_loop().create_future())
        self._end(entry, output_ids)
        self.spawn(self._answer_deadline(entry))

    async def _answer_deadline(self, entry: _Incoming) -> None:
        await asyncio.sleep(_ANSWER_WAIT_S)
        if self.requests.get(entry.request.request_id) is entry:
            self.log.warning("answer.unclaimed", request_id=entry.request.request_id)
            self.finish(entry.request.request_id)

    def on_return_slots(self, message: KvReturnSlots) -> None:
        entry: _Incoming = self.requests.get(message.request_id)
        if entry.answer is not None:
            self.spawn(self._write_answer(entry, message))

    async def _write_answer(self, entry: _Incoming, message: KvReturnSlots) -> None:
        rid = message.request_id
        start, exported = entry.answer
        try:
            if message.slots:
                keys, values = await asyncio.wait_for(asyncio.shield(exported), _ANSWER_WAIT_S)
                arena = ArenaLayout(self.model.layout, self.block_tokens, message.num_slots, self.store_codec)
                count = len(message.slots) * self.block_tokens
                first = message.first_token - start
                for layer in range(self.model.layout.num_layers):
                    k, v = keys[layer][first : first + count], values[layer][first : first + count]
                    # from device memory through a staging buffer, copied off the event loop
                    async with self.stager.to_host([k, v]) as (k, v):
                        for header, data in into_slots(rid, arena, message.region, layer, k, v, message.slots,
                                                       message.first_token):
                            await self.to_shuttle.write(message.address, header, data)
        except (transports.TransportError, asyncio.TimeoutError) as exc:
            self.log.warning("answer.not_stored", request_id=rid, error=repr(exc))
            self.spawn(self.send_output("destination", entry.request.route, KvReleased(rid)))  # do not wait for it
        finally:
            if self.requests.get(rid) is entry:
                self.finish(rid)
