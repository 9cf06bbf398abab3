"""Prometheus metrics, served by ingress at ``GET /metrics`` (text exposition format).

Two kinds, both in one registry per ingress:

- **Requests**, counted by ingress as they pass through it: requests by outcome, HTTP refusals
  by status, prompt / cached / generated tokens, and the latency histograms a serving SLO is
  written in: time to first token, time between tokens (each gap between two text deltas,
  divided among the tokens it brought) and end to end.
- **Stages**, read when scraped from what the launcher last reported of every replica (its
  state, requests in flight, restarts, and the counters the stage sends with each heartbeat):
  replica counts by state, queue depths, decode batch sizes, KV bytes each stage sent over the
  data plane per peer stage, store lookups, hits, bytes per tier. Counters of a replica start
  again from 0 when it restarts (Prometheus's ``rate()`` takes that as a reset).

The metric names are listed in ``docs/design.md`` ("Metrics"); ``pdflow top`` reads this endpoint.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no *_created series: a restart shows as a counter reset all the same

# seconds; TTFT spans a cached prompt on a fast link (ms) to a long prompt behind a queue (minutes)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_TBT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)

# heartbeat counters of a stage that become metrics of their own (the rest: pdflow_stage_counter)
_STORE_COUNTERS = {"lookups": "lookups", "hits": "hits", "hit_tokens": "hit tokens", "evictions": "evictions",
                   "commits": "commits"}
_STORE_GAUGES = {"bytes_used": ("memory", "used"), "bytes_total": ("memory", "capacity"),
                 "disk_bytes_used": ("disk", "used"), "disk_bytes_capacity": ("disk", "capacity")}
_RECENT = 20_000  # samples kept for window_p90
_SENT_PREFIX = "kv_sent_bytes@"  # kv_sent_bytes@<peer stage>: see Stage.sent_stats


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
        r.register(_StageCollector(ingress))
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
            self.recent_ttft.append((now, now - pending.received))
            new -= 1  # the first token's wait is TTFT, not a gap
        elif new > 0:
            gap = (now - pending.last_token_at) / new
            for _ in range(new):
                self.tbt.observe(gap)
            self.recent_tbt.append((now, gap))
        pending.last_token_at = now
        self.generation_tokens.inc(completion_tokens - pending.counted_tokens)
        pending.counted_tokens = completion_tokens

    def finished(self, pending) -> None:
        self.requests.labels("finished").inc()
        self.prompt_tokens.inc(pending.prompt_len)
        self.cached_tokens.inc(pending.cached_tokens)
        self.e2e.observe((pending.last_token_at or time.monotonic()) - pending.received)

    def ended(self, reason: str) -> None:
        """A request that did not finish: cancelled by its client, or failed (``reason``: why)."""
        self.requests.labels("cancelled" if "disconnect" in reason else "failed").inc()

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


class _StageCollector:
    """The replicas' state and heartbeat counters, as the launcher last reported them."""

    def __init__(self, ingress) -> None:
        self.ingress = ingress

    def describe(self):
        return []

    def collect(self):
        pipeline, reports = self.ingress.pipeline, self.ingress.stage_status
        configured = GaugeMetricFamily("pdflow_replicas_configured", "Replicas of each stage in the topology.",
                                       labels=["stage"])
        states = GaugeMetricFamily("pdflow_replicas", "Replicas of each stage by state (ready, starting, restarting, "
                                   "unreported).", labels=["stage", "state"])
        in_flight = GaugeMetricFamily("pdflow_stage_in_flight", "Requests a replica holds (its queue and batch).",
                                      labels=["stage", "replica"])
        restarts = CounterMetricFamily("pdflow_stage_restarts", "Times the launcher restarted a replica.",
                                       labels=["stage", "replica"])
        batch = GaugeMetricFamily("pdflow_decode_batch_size", "Sequences in a replica's decode batch now.",
                                  labels=["stage", "replica"])
        steps = CounterMetricFamily("pdflow_decode_steps", "Decode steps a replica ran.", labels=["stage", "replica"])
        rows = CounterMetricFamily("pdflow_decode_step_rows", "Sequences stepped, summed over decode steps "
                                   "(÷ steps: the mean batch size).", labels=["stage", "replica"])
        sent = CounterMetricFamily("pdflow_kv_sent_bytes", "KV bytes a replica wrote over the data plane, by the "
                                   "stage it wrote to.", labels=["stage", "replica", "peer"])
        store = {key: CounterMetricFamily(f"pdflow_kv_store_{key}", f"KV store {words}.", labels=["stage", "replica"])
                 for key, words in _STORE_COUNTERS.items()}
        hit_ratio = GaugeMetricFamily("pdflow_kv_store_hit_ratio", "Store lookups that found at least one block, "
                                      "of all lookups so far.", labels=["stage", "replica"])
        tier_bytes = GaugeMetricFamily("pdflow_kv_store_bytes", "KV store bytes per tier, used and capacity.",
                                       labels=["stage", "replica", "tier", "kind"])
        other = GaugeMetricFamily("pdflow_stage_counter", "Any other counter a replica reports with its heartbeats.",
                                  labels=["stage", "replica", "name"])
        for name, stage in pipeline.stages.items():
            display = stage.display_name
            configured.add_metric([display], stage.replicas)
            counts = dict.fromkeys(("ready", "starting", "restarting", "unreported"), 0)
            for replica in range(stage.replicas):
                report = reports.get(f"{display}-{replica}")
                if report is None:
                    counts["unreported"] += 1
                    continue
                counts[report["state"]] = counts.get(report["state"], 0) + 1
                labels = [display, str(replica)]
                in_flight.add_metric(labels, report["in_flight"])
                restarts.add_metric(labels, report["restarts"])
                for key, value in report.get("stats", {}).items():
                    if key == "batch_size":
                        batch.add_metric(labels, value)
                    elif key == "decode_steps":
                        steps.add_metric(labels, value)
                    elif key == "decode_step_rows":
                        rows.add_metric(labels, value)
                    elif key.startswith(_SENT_PREFIX):
                        sent.add_metric([*labels, key[len(_SENT_PREFIX):]], value)
                    elif key in _STORE_COUNTERS:
                        store[key].add_metric(labels, value)
                    elif key in _STORE_GAUGES:
                        tier_bytes.add_metric([*labels, *_STORE_GAUGES[key]], value)
                    else:
                        other.add_metric([*labels, key], value)
                stats = report.get("stats", {})
                if "lookups" in stats:
                    hit_ratio.add_metric(labels, stats["hits"] / stats["lookups"] if stats["lookups"] else 0.0)
            for state, count in counts.items():
                states.add_metric([display, state], count)
        yield from (configured, states, in_flight, restarts, batch, steps, rows, sent, *store.values(), hit_ratio,
                    tier_bytes, other)
