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
from pdflow.messages import (
    Cancel,
    DecodeRequest,
    KvDestination,
    KvReleased,
    PrefillDone,
    RequestFailed,
    StopRequest,
    Tokens,
)
from pdflow.runtime.stage import Stage


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


class DecodeStage(Stage):
    name = "decode"

    async def setup(self) -> None:
        topo, cfg = self.topology, self.ctx.config
        self.model = await asyncio.to_thread(load_model, self.ctx.model_dir, topo.model.dtype, cfg.device)
        link = topo.link("kv_shuttle", "decode")
        self.from_shuttle = transports.create(
            link.transport, host=cfg.host, port=cfg.data_port_of(self.replica), **link.options
        )
        await self.from_shuttle.start()
        self.batch = DecodeBatch(self.model, self.limits.max_batch)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="decode-step")
        self.incoming: dict[str, _Incoming] = {}
        self.by_region: dict[int, _Incoming] = {}
        self.early_done: dict[str, PrefillDone] = {}  # PrefillDone that beat its DecodeRequest here
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
            Cancel: lambda m: self._drop(m.request_id),
            StopRequest: lambda m: self._drop(m.request_id),
        }

    def in_flight(self) -> int:
        return len(self.incoming) + len(self.waiting) + len(self.running)

    # --- KV arrival -------------------------------------------------------------------------

    async def on_request(self, message: DecodeRequest) -> None:
        layout = self.model.layout
        nbytes = layout.request_bytes(message.prompt_len)
        region = self._next_region
        self._next_region += 1
        buffer = torch.frombuffer(self.from_shuttle.allocate(region, nbytes), dtype=torch.uint8)
        entry = _Incoming(message, buffer, region, 2 * layout.num_layers, [0.0] * layout.num_layers)
        self.incoming[message.request_id] = entry
        self.by_region[region] = entry
        destination = KvDestination(message.request_id, self.from_shuttle.address_for(region), region, nbytes)
        await self.bus.send("kv_shuttle", message.route.shuttle, destination)
        early = self.early_done.pop(message.request_id, None)
        if early is not None:
            self.on_prefill_done(early)

    def on_prefill_done(self, message: PrefillDone) -> None:
        entry = self.incoming.get(message.request_id)
        if entry is None:
            if len(self.early_done) < 10_000:
                self.early_done[message.request_id] = message
            return
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
                rid = entry.request.request_id
                self._release(entry)
                failure = RequestFailed(rid, "decode", f"KV chunk lost on its way to decode: {notice.error!r}")
                await self.bus.send("ingress", entry.request.route.ingress, failure)
                continue
            entry.chunks_left -= 1
            layer = notice.header.layer
            entry.layer_in[layer] = max(entry.layer_in[layer], notice.received_at)
            self._maybe_complete(entry)

    def _maybe_complete(self, entry: _Incoming) -> None:
        if entry.chunks_left or entry.done is None:
            return
        self._release(entry)
        if not entry.done.finished:
            self.waiting.append(entry)
            self.wake.set()

    def _release(self, entry: _Incoming) -> None:
        """The KV is all here (or lost): stop receiving into it, let the shuttle free its copy."""
        rid = entry.request.request_id
        self.incoming.pop(rid, None)
        self.by_region.pop(entry.region, None)
        self.from_shuttle.unregister(entry.region)
        self.spawn(self.bus.send("kv_shuttle", entry.request.route.shuttle, KvReleased(rid)))

    def _drop(self, request_id: str) -> None:
        self.early_done.pop(request_id, None)
        entry = self.incoming.get(request_id)
        if entry is not None:
            self._release(entry)
        self.waiting = [e for e in self.waiting if e.request.request_id != request_id]
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
                timeline = dict(entry.done.timeline)
                timeline["decode.layer_in"] = entry.layer_in
                timeline["decode.joined"] = [seq.extra["joined"]]
                timeline["decode.steps"] = seq.extra["steps"]
                timeline["decode.end"] = [now]
            message = Tokens(seq.request_id, seq.generated - 1, [token], reason, timeline)
            await self.bus.send("egress", entry.request.route.egress, message)
