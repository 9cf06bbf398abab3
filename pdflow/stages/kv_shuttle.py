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
from pdflow.messages import Cancel, KvChunkHeader, KvDestination, KvExpected, KvReleased, RequestFailed
from pdflow.runtime.stage import Stage

POOL_BYTES = 8 << 30  # the pool's budget; a request beyond it is refused


@dataclass(slots=True, eq=False)
class _Entry:
    request: KvExpected
    buffer: torch.Tensor
    region: int
    forwards: set = field(default_factory=set)


class KvShuttleStage(Stage):
    name = "kv_shuttle"

    async def setup(self) -> None:
        topo, cfg = self.topology, self.ctx.config
        config = await asyncio.to_thread(AutoConfig.from_pretrained, self.ctx.model_dir)
        self.layout = KvLayout.from_config(config, topo.model.dtype)
        inbound = topo.link("prefill", "kv_shuttle")
        self.from_prefill = transports.create(
            inbound.transport, host=cfg.host, port=cfg.data_port_of(self.replica), **inbound.options
        )
        await self.from_prefill.start()
        outbound = topo.link("kv_shuttle", "decode")
        self.to_decode = transports.create(outbound.transport, host=cfg.host, **outbound.options)
        self.entries: dict[str, _Entry] = {}
        # decode may name its destination before ingress's KvExpected gets here: either may come first
        self.decode_destinations: dict[str, asyncio.Future[KvDestination]] = {}
        self.by_region: dict[int, _Entry] = {}
        self.pool_used = 0
        self._next_region = 0
        self.spawn(self._notice_loop(), essential=True)

    async def teardown(self) -> None:
        await self.from_prefill.aclose()
        await self.to_decode.aclose()

    def handlers(self):
        return {
            KvExpected: self.on_expected,
            KvDestination: self.on_decode_destination,
            KvReleased: lambda m: self._free(m.request_id),
            Cancel: self.on_cancel,
        }

    def in_flight(self) -> int:
        return len(self.entries)

    async def on_expected(self, message: KvExpected) -> None:
        nbytes = self.layout.request_bytes(message.num_tokens)
        if self.pool_used + nbytes > POOL_BYTES:
            await self._fail(message, f"KV pool full ({self.pool_used} of {POOL_BYTES} bytes in use)")
            return
        region = self._next_region
        self._next_region += 1
        buffer = torch.frombuffer(self.from_prefill.allocate(region, nbytes), dtype=torch.uint8)
        entry = _Entry(message, buffer, region)
        self.entries[message.request_id] = entry
        self.by_region[region] = entry
        self.pool_used += nbytes
        destination = KvDestination(message.request_id, self.from_prefill.address_for(region), region, nbytes)
        await self.bus.send("prefill", message.route.prefill, destination)

    def _decode_destination(self, request_id: str) -> asyncio.Future[KvDestination]:
        future = self.decode_destinations.get(request_id)
        if future is None:
            future = self.decode_destinations[request_id] = asyncio.get_running_loop().create_future()
        return future

    def on_decode_destination(self, message: KvDestination) -> None:
        future = self._decode_destination(message.request_id)
        if not future.done():
            future.set_result(message)

    def on_cancel(self, message: Cancel) -> None:
        self._free(message.request_id)
        future = self.decode_destinations.pop(message.request_id, None)
        if future is not None:
            future.cancel()

    def _free(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return
        self.decode_destinations.pop(request_id, None)
        self.by_region.pop(entry.region, None)
        self.from_prefill.unregister(entry.region)
        for task in entry.forwards:
            task.cancel()
        self.pool_used -= entry.buffer.numel()

    async def _fail(self, request: KvExpected, message: str) -> None:
        self.log.error("kv.request.failed", request_id=request.request_id, error=message)
        failure = RequestFailed(request.request_id, "kv-shuttle", message)
        await self.bus.send("ingress", request.route.ingress, failure)

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
                await self._fail(entry.request, f"KV chunk from prefill lost: {notice.error!r}")
                self._free(entry.request.request_id)
                continue
            task = asyncio.ensure_future(self._forward(entry, notice.header))
            entry.forwards.add(task)
            task.add_done_callback(entry.forwards.discard)

    async def _forward(self, entry: _Entry, header: KvChunkHeader) -> None:
        try:
            destination = await asyncio.wait_for(
                asyncio.shield(self._decode_destination(entry.request.request_id)), self.limits.request_timeout_s
            )
            data = transports.byte_view(entry.buffer[header.offset : header.offset + header.nbytes])
            await self.to_decode.write(destination.address, msgspec.structs.replace(header, region=destination.region), data)
        except asyncio.CancelledError:
            pass
        except (transports.TransportError, asyncio.TimeoutError) as exc:
            if entry.request.request_id in self.entries:
                await self._fail(entry.request, f"KV transfer to decode failed: {exc!r}")
                self._free(entry.request.request_id)
