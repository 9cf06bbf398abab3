"""prefill: runs each prompt through the model and streams every layer's KV the moment it exists.

The forward pass runs in a worker thread; each layer's keys and values are queued to the event
loop, which writes them into the kv-shuttle's pool over the data plane while the next layers
compute. The first token goes to output ``tokens`` (egress); output ``done`` (decode) learns it
from :class:`PrefillDone` — unless the request ended here meanwhile (cancelled), then nothing
more is sent for it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdflow import transports
from pdflow.engine import Sampler, load_model, prefill
from pdflow.engine.stopping import finish_reason
from pdflow.kv.layout import KEYS, VALUES, checksum
from pdflow.messages import KvChunkHeader, KvDestination, PrefillDone, PrefillRequest, Tokens
from pdflow.runtime.stage import Stage, Submission


@dataclass(slots=True, eq=False)
class _Job:
    request: PrefillRequest
    destination: asyncio.Future  # the KvDestination kv-shuttle names
    cancelled: bool = False
    send_start: float | None = None  # when its first KV write began

    @property
    def route(self):
        return self.request.route


class PrefillStage(Stage):
    kind = "prefill"
    # kv: the stage whose pool the KV is written into (over the data-plane link to it)
    outputs = {"tokens": "egress", "done": "decode", "kv": "kv_shuttle"}
    opens = (PrefillRequest,)

    @classmethod
    def admission(cls, submission: Submission, name: str) -> PrefillRequest:
        return PrefillRequest(submission.request_id, submission.prompt_ids, submission.sampling, submission.route)

    async def setup(self) -> None:
        topo, cfg = self.pipeline, self.config
        self.model = await asyncio.to_thread(load_model, self.ctx.model_dir, topo.model.dtype, cfg.device)
        link = topo.link(self.ctx.stage, self.output("kv"))
        self.to_shuttle = transports.create(link.transport, host=cfg.host, **link.options)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prefill-forward")
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.spawn(self._worker(), essential=True)

    async def teardown(self) -> None:
        await self.to_shuttle.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def handlers(self):
        return {PrefillRequest: self.on_request, KvDestination: self.on_destination}

    def on_request(self, message: PrefillRequest) -> None:
        job = _Job(message, asyncio.get_running_loop().create_future())
        self.queue.put_nowait(self.requests.open(message.request_id, job))

    def on_destination(self, message: KvDestination) -> None:
        job: _Job = self.requests.get(message.request_id)
        if not job.destination.done():
            job.destination.set_result(message)

    def on_cancel(self, request_id: str, job: _Job, reason: str) -> None:
        job.cancelled = True
        job.destination.cancel()

    async def _worker(self) -> None:
        while True:
            job = await self.queue.get()
            if job.cancelled:
                continue
            try:
                await self._prefill(job)
            except Exception as exc:
                self.log.exception("prefill.failed", request_id=job.request.request_id)
                await self.fail(job.request.request_id, f"prefill failed: {exc}", job.route)
            finally:
                self.finish(job.request.request_id)

    async def _prefill(self, job: _Job) -> None:
        request = job.request
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue = asyncio.Queue()

        def sink(layer, keys, values) -> None:  # on the forward thread
            loop.call_soon_threadsafe(layers.put_nowait, (layer, keys, values))

        computed = asyncio.Event()
        sender = asyncio.ensure_future(self._send_layers(job, layers, computed))
        sampler = Sampler(request.sampling)
        try:
            result = await loop.run_in_executor(self.executor, prefill, self.model, request.prompt_ids, sampler, sink)
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
                   "prefill.end": [result.finished]}
        # a request that ends here gets its (prefill-only) timeline with its only token
        first = Tokens(request.request_id, 0, [token], reason, compute if reason is not None else {})
        await self.send_output("tokens", request.route, first)
        self.log.info("prefill.done", request_id=request.request_id, tokens=n, seconds=round(result.finished - result.started, 4))
        sent = await sender
        if sent is None or job.cancelled:
            return  # cancelled, or failed and reported
        timeline = {**compute, "prefill.send_start": [job.send_start or result.started], "prefill.layer_sent": sent}
        await self.send_output("done", request.route, PrefillDone(request.request_id, token, reason is not None, timeline))

    async def _send_layers(self, job: _Job, layers: asyncio.Queue, computed: asyncio.Event) -> list[float] | None:
        """Write each layer's keys and values into the shuttle's region as they come (with
        ``kv_streaming = "request"``: only once the whole prefill is computed)."""
        request = job.request
        rid, n = request.request_id, len(request.prompt_ids)
        layout = self.model.layout
        sent: list[float] = []
        try:
            destination = await asyncio.wait_for(asyncio.shield(job.destination), self.limits.request_timeout_s)
            if self.pipeline.engine.kv_streaming == "request":
                await computed.wait()
            job.send_start = time.monotonic()
            for _ in range(layout.num_layers):
                layer, keys, values = await layers.get()
                if job.cancelled:
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
            await self.fail(rid, f"KV transfer to kv-shuttle failed: {exc!r}", request.route)
            return None
