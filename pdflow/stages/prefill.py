"""prefill: runs each prompt through the model and streams every layer's KV the moment it exists.

The forward pass runs in a worker thread; each layer's keys and values are queued to the event
loop, which writes them into the kv-shuttle's pool over the data plane while the next layers
compute. The first token goes straight to egress; decode learns it from :class:`PrefillDone`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from pdflow import transports
from pdflow.engine import Sampler, load_model, prefill
from pdflow.engine.stopping import finish_reason
from pdflow.kv.layout import KEYS, VALUES, checksum
from pdflow.messages import (
    Cancel,
    KvChunkHeader,
    KvDestination,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    Tokens,
)
from pdflow.runtime.stage import Stage


class PrefillStage(Stage):
    name = "prefill"

    async def setup(self) -> None:
        topo, cfg = self.topology, self.ctx.config
        self.model = await asyncio.to_thread(load_model, self.ctx.model_dir, topo.model.dtype, cfg.device)
        link = topo.link("prefill", "kv_shuttle")
        self.to_shuttle = transports.create(link.transport, host=cfg.host, **link.options)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prefill-forward")
        self.queue: asyncio.Queue[PrefillRequest] = asyncio.Queue()
        self.destinations: dict[str, asyncio.Future[KvDestination]] = {}
        self.held: set[str] = set()  # queued or running
        self.send_start: dict[str, float] = {}  # when each request's first KV write began
        self.cancelled: set[str] = set()
        self.running: str | None = None
        self.spawn(self._worker(), essential=True)

    async def teardown(self) -> None:
        await self.to_shuttle.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def handlers(self):
        return {PrefillRequest: self.on_request, KvDestination: self.on_destination, Cancel: self.on_cancel}

    def on_request(self, message: PrefillRequest) -> None:
        self.held.add(message.request_id)
        self.queue.put_nowait(message)

    def in_flight(self) -> int:
        return self.queue.qsize() + (self.running is not None)

    def _destination(self, request_id: str) -> asyncio.Future[KvDestination]:
        return self.destinations.setdefault(request_id, asyncio.get_running_loop().create_future())

    def on_destination(self, message: KvDestination) -> None:
        future = self._destination(message.request_id)
        if not future.done():
            future.set_result(message)

    def on_cancel(self, message: Cancel) -> None:
        if message.request_id in self.held:
            self.cancelled.add(message.request_id)
        future = self.destinations.pop(message.request_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def _worker(self) -> None:
        while True:
            request = await self.queue.get()
            if request.request_id in self.cancelled:
                self.cancelled.discard(request.request_id)
                self.held.discard(request.request_id)
                continue
            self.running = request.request_id
            try:
                await self._prefill(request)
            except Exception as exc:
                self.log.exception("prefill.failed", request_id=request.request_id)
                await self._fail(request, f"prefill failed: {exc}")
            finally:
                self.running = None
                self.held.discard(request.request_id)
                self.cancelled.discard(request.request_id)
                self.send_start.pop(request.request_id, None)
                self.destinations.pop(request.request_id, None)

    async def _fail(self, request: PrefillRequest, message: str) -> None:
        await self.bus.send("ingress", request.route.ingress, RequestFailed(request.request_id, "prefill", message))

    async def _prefill(self, request: PrefillRequest) -> None:
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue = asyncio.Queue()

        def sink(layer, keys, values) -> None:  # on the forward thread
            loop.call_soon_threadsafe(layers.put_nowait, (layer, keys, values))

        computed = asyncio.Event()
        sender = asyncio.ensure_future(self._send_layers(request, layers, computed))
        sampler = Sampler(request.sampling)
        try:
            result = await loop.run_in_executor(self.executor, prefill, self.model, request.prompt_ids, sampler, sink)
        except BaseException:
            sender.cancel()
            raise
        computed.set()
        token = result.first_token
        n = len(request.prompt_ids)
        reason = finish_reason(token, 1, n + 1, request.sampling, self.model.eos_token_ids, self.model.max_context)
        route = request.route
        compute = {"prefill.start": [result.started], "prefill.layer_done": result.layer_done,
                   "prefill.end": [result.finished]}
        # a request that ends here gets its (prefill-only) timeline with its only token
        first = Tokens(request.request_id, 0, [token], reason, compute if reason is not None else {})
        await self.bus.send("egress", route.egress, first)
        self.log.info("prefill.done", request_id=request.request_id, tokens=n, seconds=round(result.finished - result.started, 4))
        sent = await sender
        if sent is None:
            return  # cancelled, or failed and reported
        timeline = {
            **compute,
            "prefill.send_start": [self.send_start.pop(request.request_id, result.started)],
            "prefill.layer_sent": sent,
        }
        await self.bus.send("decode", route.decode, PrefillDone(request.request_id, token, reason is not None, timeline))

    async def _send_layers(
        self, request: PrefillRequest, layers: asyncio.Queue, computed: asyncio.Event
    ) -> list[float] | None:
        """Write each layer's keys and values into the shuttle's region as they come (with
        ``kv_streaming = "request"``: only once the whole prefill is computed)."""
        rid, n = request.request_id, len(request.prompt_ids)
        layout = self.model.layout
        sent: list[float] = []
        try:
            destination = await asyncio.wait_for(self._destination(rid), self.limits.request_timeout_s)
            if self.topology.engine.kv_streaming == "request":
                await computed.wait()
            self.send_start[rid] = time.monotonic()
            for _ in range(layout.num_layers):
                layer, keys, values = await layers.get()
                if rid in self.cancelled:
                    return None
                for kind, tensor in ((KEYS, keys), (VALUES, values)):
                    data = transports.byte_view(tensor if tensor.device.type == "cpu" else tensor.cpu())
                    header = KvChunkHeader(
                        rid, layer, kind, 0, n, layout.dtype, tuple(tensor.shape),
                        destination.region, layout.offset(n, layer, kind), len(data), checksum(data),
                    )
                    await self.to_shuttle.write(destination.address, header, data)
                sent.append(time.monotonic())
            return sent
        except asyncio.CancelledError:
            return None
        except (transports.TransportError, asyncio.TimeoutError) as exc:
            self.log.error("kv.send.failed", request_id=rid, error=repr(exc))
            await self._fail(request, f"KV transfer to kv-shuttle failed: {exc!r}")
            return None
