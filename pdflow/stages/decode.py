"""decode: receives each request's KV into memory it registered, then decodes it in a running batch.

Requests join and leave the batch between steps (continuous batching). A request joins once
all its layers have landed and prefill has said which token comes first. Each step runs in a
worker thread; its tokens go to egress.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdflow import transports
from pdflow.engine import DecodeBatch, Sampler, Sequence, load_model
from pdflow.engine.stopping import after_decode_step
from pdflow.messages import DecodeRequest, KvDestination, KvReleased, PrefillDone, StopRequest, Tokens
from pdflow.runtime.stage import Stage, Submission


@dataclass(slots=True, eq=False)
class _Incoming:
    """A request whose KV is still landing."""

    request: DecodeRequest
    buffer: torch.Tensor | None
    region: int
    chunks_left: int
    layer_in: list[float]
    done: PrefillDone | None = None
    created: float = field(default_factory=time.monotonic)

    @property
    def route(self):
        return self.request.route


class DecodeStage(Stage):
    kind = "decode"
    outputs = {"tokens": "egress", "destination": "kv_shuttle"}
    opens = (DecodeRequest,)
    receives_kv = True

    @classmethod
    def admission(cls, submission: Submission, name: str) -> DecodeRequest:
        return DecodeRequest(submission.request_id, len(submission.prompt_ids), submission.sampling, submission.route)

    async def setup(self) -> None:
        topo, cfg = self.pipeline, self.config
        self.model = await asyncio.to_thread(load_model, self.ctx.model_dir, topo.model.dtype, cfg.device)
        link = topo.link(self.output("destination"), self.ctx.stage)
        self.from_shuttle = transports.create(
            link.transport, host=cfg.host, port=cfg.data_port_of(self.replica), **link.options
        )
        await self.from_shuttle.start()
        self.batch = DecodeBatch(self.model, self.limits.max_batch)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="decode-step")
        self.by_region: dict[int, _Incoming] = {}  # KV still landing
        self.waiting: list[_Incoming] = []  # all KV here, not yet in the batch
        self.running: dict[str, Sequence] = {}
        self.to_remove: set[str] = set()
        self.wake = asyncio.Event()
        self._next_region = 0
        self.spawn(self._notice_loop(), essential=True)
        self.spawn(self._step_loop(), essential=True)

    async def teardown(self) -> None:
        await self.from_shuttle.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def handlers(self):
        return {
            DecodeRequest: self.on_request,
            PrefillDone: self.on_prefill_done,
            StopRequest: lambda m: self.cancel(m.request_id, "stop string matched"),
        }

    # --- KV arrival -------------------------------------------------------------------------

    async def on_request(self, message: DecodeRequest) -> None:
        layout = self.model.layout
        nbytes = layout.request_bytes(message.prompt_len)
        region = self._next_region
        self._next_region += 1
        buffer = torch.frombuffer(self.from_shuttle.allocate(region, nbytes), dtype=torch.uint8)
        entry = _Incoming(message, buffer, region, 2 * layout.num_layers, [0.0] * layout.num_layers)
        self.requests.open(message.request_id, entry)
        self.by_region[region] = entry
        destination = KvDestination(message.request_id, self.from_shuttle.address_for(region), region, nbytes)
        await self.send_output("destination", message.route, destination)

    def on_prefill_done(self, message: PrefillDone) -> None:
        entry: _Incoming = self.requests.get(message.request_id)
        entry.done = message
        self._maybe_complete(entry)

    async def _notice_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                notice = await self.from_shuttle.next_notice()
            except transports.TransportClosed:
                return
            entry = self.by_region.get(notice.header.region)
            if entry is None:
                continue
            if notice.error is not None:
                error = f"KV chunk lost on its way to decode: {notice.error!r}"
                await self.fail(entry.request.request_id, error, entry.request.route)
                continue
            entry.chunks_left -= 1
            layer = notice.header.layer
            entry.layer_in[layer] = max(entry.layer_in[layer], notice.received_at)
            self._maybe_complete(entry)

    def _maybe_complete(self, entry: _Incoming) -> None:
        if entry.chunks_left or entry.done is None:
            return
        self._release(entry)
        if entry.done.finished:
            self.finish(entry.request.request_id)
        else:
            self.waiting.append(entry)
            self.wake.set()

    def _release(self, entry: _Incoming) -> None:
        """The KV is all here (or lost): stop receiving into it, let the shuttle free its copy."""
        if self.by_region.pop(entry.region, None) is None:
            return
        self.from_shuttle.unregister(entry.region)
        rid = entry.request.request_id
        self.spawn(self.send_output("destination", entry.request.route, KvReleased(rid)))

    def on_cancel(self, request_id: str, entry: _Incoming, reason: str) -> None:
        self._release(entry)
        if entry in self.waiting:
            self.waiting.remove(entry)
        if request_id in self.running:
            self.to_remove.add(request_id)
            self.wake.set()

    # --- the batch --------------------------------------------------------------------------

    def _admit(self, entries: list[_Incoming]) -> list[Sequence]:
        """On the step thread: copy each request's KV into a row of the batch."""
        layout = self.model.layout
        admitted = []
        for entry in entries:
            n = entry.request.prompt_len
            buffer = entry.buffer.to(self.model.device)
            seq = Sequence(entry.request.request_id, n, entry.done.first_token, Sampler(entry.request.sampling))
            self.batch.add(seq, lambda layer: layout.views(buffer, n, layer))
            entry.buffer = buffer = None  # the batch holds the KV now: free the receive buffer
            seq.extra = {"entry": entry, "joined": time.monotonic(), "steps": []}
            admitted.append(seq)
        return admitted

    def _step(self, admit: list[_Incoming], remove: list[Sequence]) -> tuple[list[Sequence], list]:
        for seq in remove:
            self.batch.remove(seq)
        admitted = self._admit(admit)
        return admitted, self.batch.step()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            room = self.limits.max_batch - len(self.running) + len(self.to_remove)
            admit, self.waiting = self.waiting[:room], self.waiting[room:]
            remove = [self.running.pop(rid) for rid in self.to_remove if rid in self.running]
            self.to_remove.clear()
            admitted, results = await loop.run_in_executor(self.executor, self._step, admit, remove)
            for seq in admitted:
                self.running[seq.request_id] = seq
                if seq.request_id not in self.requests:  # cancelled while it joined
                    self.to_remove.add(seq.request_id)
            await self._emit(results)

    async def _emit(self, results: list[tuple[Sequence, int]]) -> None:
        now = time.monotonic()
        for seq, token in results:
            if seq.request_id not in self.running or seq.request_id in self.to_remove:
                continue
            reason = after_decode_step(seq, token, self.model, now)
            entry: _Incoming = seq.extra["entry"]
            timeline = {}
            if reason is not None:
                self.to_remove.add(seq.request_id)
                self.finish(seq.request_id)
                timeline = dict(entry.done.timeline)
                timeline["decode.layer_in"] = entry.layer_in
                timeline["decode.joined"] = [seq.extra["joined"]]
                timeline["decode.steps"] = seq.extra["steps"]
                timeline["decode.end"] = [now]
            message = Tokens(seq.request_id, seq.generated - 1, [token], reason, timeline)
            await self.send_output("tokens", entry.request.route, message)
