"""kv-shuttle: owns the CPU-memory KV pool and moves each request's KV from prefill to decode.

For every request it reserves a region of the pool and gives prefill its address; each chunk
that lands is forwarded at once to the region decode registered (cut-through, layer by layer).
The region is freed when decode confirms it holds the KV (or the request is cancelled).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import torch
from transformers import AutoConfig

from pdflow import transports
from pdflow.kv.layout import KvLayout
from pdflow.messages import KvChunkHeader, KvDestination, KvExpected, KvReleased
from pdflow.runtime.stage import Stage, Submission

POOL_BYTES = 8 << 30  # the pool's budget; a request beyond it is refused


@dataclass(slots=True, eq=False)
class _Entry:
    request: KvExpected
    buffer: torch.Tensor
    region: int
    decode_destination: asyncio.Future  # where decode wants the KV (it may say so before we know the request)
    forwards: set = field(default_factory=set)

    @property
    def route(self):
        return self.request.route


class KvShuttleStage(Stage):
    kind = "kv_shuttle"
    outputs = {"destination": "prefill", "kv": "decode"}
    opens = (KvExpected,)
    receives_kv = True

    @classmethod
    def admission(cls, submission: Submission, name: str) -> KvExpected:
        return KvExpected(submission.request_id, len(submission.prompt_ids), submission.route)

    async def setup(self) -> None:
        topo, cfg = self.pipeline, self.config
        config = await asyncio.to_thread(AutoConfig.from_pretrained, self.ctx.model_dir)
        self.layout = KvLayout.from_config(config, topo.model.dtype)
        inbound = topo.link(self.output("destination"), self.ctx.stage)
        self.from_prefill = transports.create(
            inbound.transport, host=cfg.host, port=cfg.data_port_of(self.replica), **inbound.options
        )
        await self.from_prefill.start()
        outbound = topo.link(self.ctx.stage, self.output("kv"))
        self.to_decode = transports.create(outbound.transport, host=cfg.host, **outbound.options)
        self.by_region: dict[int, _Entry] = {}
        self.pool_used = 0
        self._next_region = 0
        self.spawn(self._notice_loop(), essential=True)

    async def teardown(self) -> None:
        await self.from_prefill.aclose()
        await self.to_decode.aclose()

    def handlers(self):
        return {KvExpected: self.on_expected, KvDestination: self.on_decode_destination, KvReleased: self.on_released}

    async def on_expected(self, message: KvExpected) -> None:
        nbytes = self.layout.request_bytes(message.num_tokens)
        if self.pool_used + nbytes > POOL_BYTES:
            await self.fail(message.request_id, f"KV pool full ({self.pool_used} of {POOL_BYTES} bytes in use)",
                            message.route)
            return
        region = self._next_region
        self._next_region += 1
        buffer = torch.frombuffer(self.from_prefill.allocate(region, nbytes), dtype=torch.uint8)
        future = asyncio.get_running_loop().create_future()
        entry = self.requests.open(message.request_id, _Entry(message, buffer, region, future))
        self.by_region[region] = entry
        self.pool_used += nbytes
        destination = KvDestination(message.request_id, self.from_prefill.address_for(region), region, nbytes)
        await self.send_output("destination", message.route, destination)

    def on_decode_destination(self, message: KvDestination) -> None:
        future = self.requests.get(message.request_id).decode_destination
        if not future.done():
            future.set_result(message)

    def on_released(self, message: KvReleased) -> None:
        entry = self.finish(message.request_id)
        if entry is not None:
            self._free(entry)

    def on_cancel(self, request_id: str, entry: _Entry, reason: str) -> None:
        self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self.by_region.pop(entry.region, None)
        self.from_prefill.unregister(entry.region)
        entry.decode_destination.cancel()
        for task in entry.forwards:
            task.cancel()
        self.pool_used -= entry.buffer.numel()

    async def _notice_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                notice = await self.from_prefill.next_notice()
            except transports.TransportClosed:
                return
            entry = self.by_region.get(notice.header.region)
            if entry is None:
                continue  # cancelled meanwhile
            if notice.error is not None:
                await self.fail(entry.request.request_id, f"KV chunk from prefill lost: {notice.error!r}")
                continue
            task = asyncio.ensure_future(self._forward(entry, notice.header))
            entry.forwards.add(task)
            task.add_done_callback(entry.forwards.discard)

    async def _forward(self, entry: _Entry, header: KvChunkHeader) -> None:
        rid = entry.request.request_id
        try:
            destination = await asyncio.wait_for(asyncio.shield(entry.decode_destination), self.limits.request_timeout_s)
            data = transports.byte_view(entry.buffer[header.offset : header.offset + header.nbytes])
            await self.to_decode.write(destination.address, msgspec.structs.replace(header, region=destination.region), data)
        except asyncio.CancelledError:
            pass
        except (transports.TransportError, asyncio.TimeoutError) as exc:
            if rid in self.requests:
                await self.fail(rid, f"KV transfer to decode failed: {exc!r}")
