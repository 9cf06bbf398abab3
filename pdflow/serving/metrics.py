"""Prometheus metrics, served by ingress at ``GET /metrics`` (text exposition format).

One registry per ingress, in two vocabularies side by side:

- **vLLM's** (``vllm:*``, each with a ``model_name`` label), the names and types vLLM's v1
  loggers export, so that dashboards, alert rules and autoscalers written for vLLM read pdflow
  as they are: requests running and waiting, KV cache usage, prefix cache queries and hits,
  requests by finish reason, TTFT, inter-token latency, end to end, prompt and generation
  tokens per request, the queue / prefill / decode phases, speculative decoding's counts.
- **pdflow's own** (``pdflow_*``): the same request figures as before, the disaggregation's
  histograms (KV transfer and KV tail per request), and the stages as the launcher last reported
  them (:mod:`pdflow.serving.stage_metrics`): replicas by state, queue depths, decode batches
  and pool, KV bytes per link and transport, a store's lookups, hits and bytes per tier.

Request figures are counted by ingress as they pass through it; a finished request's phases come
from its timeline (:func:`pdflow.timeline.request_phases`). The names are listed in
``docs/design.md`` ("Metrics"); ``pdflow top`` reads this endpoint; ``deploy/grafana`` holds a
dashboard that reads it.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from pdflow.serving.stage_metrics import StageCollector
from pdflow.timeline import request_phases

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no *_created series: a restart shows as a counter reset all the same

# seconds; TTFT spans a cached prompt on a fast link (ms) to a long prompt behind a queue (minutes)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_TBT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
# vLLM's buckets for its names, so that a dashboard's heatmaps line up with vLLM's own
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
# the KV path's own: a layer over shared memory (sub-ms) to a long prompt over a slow link (s)
_KV_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_RECENT = 20_000  # samples kept for window_p90
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _VllmRequests:
    """The request-level ``vllm:*`` metrics, each with the served model's ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model: str, max_context: int) -> None:
        def labelled(kind, name: str, doc: str, **kwargs):
            return kind(f"vllm:{name}", doc, ["model_name"], registry=registry, **kwargs).labels(model)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return labelled(Histogram, name, doc, buckets=buckets)

        tokens = token_buckets(max(max_context, 1))
        self.prompt_tokens = labelled(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = labelled(Counter, "generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=registry)
        self.success = {reason: success.labels(model, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _VLLM_TTFT)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _VLLM_ITL)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", _VLLM_ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _VLLM_REQUEST)
        self.request_prompt = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                            tokens)
        self.phases = {
            "queue": histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               _VLLM_REQUEST),
            "prefill": histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _VLLM_REQUEST),
            "decode": histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                _VLLM_REQUEST),
        }
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _VLLM_REQUEST)


class ServingMetrics:
    """The metrics of one ingress (``ingress``: for its pipeline and the launcher's reports)."""

    def __init__(self, ingress) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdflow_requests", "Requests that ended, by outcome (finished, failed, cancelled).",
                                ["outcome"], registry=r)
        self.refused = Counter("pdflow_http_refusals", "Requests refused with an HTTP error, by status.",
                               ["status"], registry=r)
        self.prompt_tokens = Counter("pdflow_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("pdflow_cached_prompt_tokens",
                                     "Prompt tokens of finished requests whose KV came from a store.", registry=r)
        self.generation_tokens = Counter("pdflow_generation_tokens", "Tokens generated (every request).",
                                         registry=r)
        self.ttft = Histogram("pdflow_time_to_first_token_seconds", "From the request's arrival to its first text.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("pdflow_time_between_tokens_seconds",
                             "Time between two tokens of a stream (a gap between two deltas, per token it brought).",
                             buckets=_TBT_BUCKETS, registry=r)
        self.e2e = Histogram("pdflow_e2e_request_latency_seconds", "From arrival to the last token, finished requests.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("pdflow_requests_in_flight", "Requests ingress holds now.", registry=r)
        self.in_flight.set_function(lambda: len(ingress.requests))
        model = getattr(ingress, "served_name", None) or ingress.pipeline.model.served_name
        self.kv_transfer = Histogram(
            "pdflow_kv_transfer_seconds", "Per request, from its first KV write to decode holding every layer "
            "(requests whose prefill and decode share a machine's clock).", ["model_name"], buckets=_KV_BUCKETS,
            registry=r).labels(model)
        self.kv_tail = Histogram(
            "pdflow_kv_tail_seconds", "Per request, from prefill's last layer computed to decode holding every "
            "layer: the transfer that did not hide behind prefill (same clock as pdflow_kv_transfer_seconds).",
            ["model_name"], buckets=_KV_BUCKETS, registry=r).labels(model)
        self.vllm = _VllmRequests(r, model, getattr(ingress, "max_context", 0) or 2048)
        r.register(StageCollector(ingress, model))
        # the latest TTFTs and token gaps with when they were seen, for the scaler's p90s (window_p90)
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=_RECENT)
        self.recent_tbt: deque[tuple[float, float]] = deque(maxlen=_RECENT)

    # --- what ingress calls ------------------------------------------------------------------

    def tokens_arrived(self, pending, completion_tokens: int, now: float | None = None) -> None:
        """``pending``'s stream has ``completion_tokens`` tokens now (a text delta arrived)."""
        now = time.monotonic() if now is None else now
        new = completion_tokens - pending.counted_tokens
        if new <= 0:
            return
        if pending.first_token_at is None:
            pending.first_token_at = now
            self.ttft.observe(now - pending.received)
            self.vllm.ttft.observe(now - pending.received)
            self.recent_ttft.append((now, now - pending.received))
            new -= 1  # the first token's wait is TTFT, not a gap
        elif new > 0:
            gap = (now - pending.last_token_at) / new
            for _ in range(new):
                self.tbt.observe(gap)
                self.vllm.itl.observe(gap)
            self.recent_tbt.append((now, gap))
        pending.last_token_at = now
        self.generation_tokens.inc(completion_tokens - pending.counted_tokens)
        self.vllm.generation_tokens.inc(completion_tokens - pending.counted_tokens)
        pending.counted_tokens = completion_tokens

    def finished(self, pending, timeline: dict | None = None, finish_reason: str | None = None,
                 one_clock: bool = True) -> None:
        """``pending`` finished (``finish_reason``: the OpenAI one, ``stop`` or ``length``), with
        its ``timeline``; ``one_clock``: whether the stages it went through share a clock."""
        self.requests.labels("finished").inc()
        self.prompt_tokens.inc(pending.prompt_len)
        self.cached_tokens.inc(pending.cached_tokens)
        e2e = (pending.last_token_at or time.monotonic()) - pending.received
        self.e2e.observe(e2e)
        v = self.vllm
        v.prompt_tokens.inc(pending.prompt_len)
        v.success["length" if finish_reason == "length" else "stop"].inc()
        v.e2e.observe(e2e)
        v.request_prompt.observe(pending.prompt_len)
        v.request_generation.observe(pending.counted_tokens)
        if pending.counted_tokens > 1 and pending.first_token_at is not None:  # first token to last, per token
            v.request_tpot.observe((pending.last_token_at - pending.first_token_at) / (pending.counted_tokens - 1))
        phases = request_phases(timeline, one_clock) if timeline else {}
        for name, histogram in v.phases.items():
            if name in phases:
                histogram.observe(phases[name])
        if "prefill" in phases and "decode" in phases:
            v.inference.observe(phases["prefill"] + phases["decode"])
        if "kv_transfer" in phases:
            self.kv_transfer.observe(phases["kv_transfer"])
        if "kv_tail" in phases:
            self.kv_tail.observe(phases["kv_tail"])

    def ended(self, reason: str) -> None:
        """A request that did not finish: cancelled by its client, or failed (``reason``: why)."""
        self.requests.labels("cancelled" if "disconnect" in reason else "failed").inc()
        self.vllm.success["abort"].inc()

    def refusal(self, status: int) -> None:
        self.refused.labels(str(status)).inc()

    def window_p90(self, window_s: float, now: float | None = None) -> dict[str, int]:
        """The p90 TTFT and time between tokens (µs) of what was seen in the last ``window_s``
        (for ingress's heartbeat, which the scaler reads); a figure is left out when nothing was."""
        since = (time.monotonic() if now is None else now) - window_s
        out = {}
        for key, recent in (("ttft_p90_us", self.recent_ttft), ("tbt_p90_us", self.recent_tbt)):
            values = sorted(v for at, v in recent if at >= since)
            if values:
                out[key] = int(values[min(len(values) - 1, int(0.9 * len(values)))] * 1e6)
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
