"""The stages' metrics, read when ``/metrics`` is scraped from what the launcher last reported of
every replica: its state, requests in flight, restarts, and the counters the stage sends with each
heartbeat (:meth:`pdflow.runtime.stage.Stage.stats`).

In vLLM's vocabulary (``model_name`` label; per replica also ``engine``, e.g. ``decode-0``):
requests running (in a prefill or a decode batch) and waiting (queued for prefill, or for decode's
pool blocks), KV cache usage (decode's pool; where decode attends in the store or runs colocated,
the store's memory), prefix cache queries and hits in tokens, speculative decoding's drafts and
tokens. In pdflow's: replicas by state, queue depths, decode batches and pool, KV bytes each
replica wrote per peer and transport, a store's lookups, hits and bytes per tier.

Counters of a replica start again from 0 when it restarts (Prometheus's ``rate()`` takes that as
a reset); a ratio is left to the query (``rate(hits) / rate(lookups)``), which sums across
replicas where a ratio gauge would not.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# heartbeat counters of a stage that become metrics of their own (the rest: pdflow_stage_counter)
_STORE_COUNTERS = {"lookups": "lookups", "hits": "hits", "hit_tokens": "hit tokens", "evictions": "evictions",
                   "commits": "commits"}
_STORE_GAUGES = {"bytes_used": ("memory", "used"), "bytes_total": ("memory", "capacity"),
                 "disk_bytes_used": ("disk", "used"), "disk_bytes_capacity": ("disk", "capacity")}
# speculative decoding's counts (pdflow.speculative.speculation) in vLLM's names
_SPEC_COUNTERS = {"speculative_drafts": ("spec_decode_num_drafts", "Number of spec decoding drafts."),
                  "speculative_proposed": ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                  "speculative_accepted": ("spec_decode_num_accepted_tokens", "Number of accepted tokens.")}
_POOL = {"pool_blocks": "total", "pool_free_blocks": "free", "awaiting_pool_blocks": "awaited"}
_SENT_PREFIX = "kv_sent_bytes@"  # kv_sent_bytes@<peer stage>: see Stage.sent_stats
_NETWORK_PREFIX = "kv_network_bytes@"  # kv_network_bytes@<peer stage>: of those, to another host
_READ = {"batch_size", "decode_steps", "decode_step_rows", "requests_running", "requests_waiting", "queried_tokens",
         "hit_blocks", "blocks_total", "blocks_used", "disk_loaded_blocks", "disk_load_bytes", "spill_bytes",
         *_STORE_COUNTERS, *_STORE_GAUGES, *_SPEC_COUNTERS, *_POOL}


def _transport_of(pipeline, stage: str, peer_display: str) -> str:
    """The transport of the data-plane link from ``stage`` to the stage shown as ``peer_display``
    ("peer" for a store fetching from another store, which has no link of the topology)."""
    peer = next((name for name, s in pipeline.stages.items() if s.display_name == peer_display), None)
    try:
        return pipeline.link(stage, peer).transport
    except KeyError:
        return "peer"


class _Families:
    """The metric families of one scrape, filled replica by replica."""

    def __init__(self, model: str) -> None:
        self.model = model
        g, c = GaugeMetricFamily, CounterMetricFamily
        sr = ["stage", "replica"]
        self.configured = g("pdflow_replicas_configured", "Replicas of each stage in the topology.", labels=["stage"])
        self.states = g("pdflow_replicas", "Replicas of each stage by state (ready, starting, restarting, unreported).",
                        labels=["stage", "state"])
        self.in_flight = g("pdflow_stage_in_flight", "Requests a replica holds (its queue and batch).", labels=sr)
        self.restarts = c("pdflow_stage_restarts", "Times the launcher restarted a replica.", labels=sr)
        self.batch = g("pdflow_decode_batch_size", "Sequences in a replica's decode batch now.", labels=sr)
        self.steps = c("pdflow_decode_steps", "Decode steps a replica ran.", labels=sr)
        self.rows = c("pdflow_decode_step_rows", "Sequences stepped, summed over decode steps (÷ steps: the mean "
                      "batch size).", labels=sr)
        self.pool = g("pdflow_decode_pool_blocks", "Decode's KV pool: blocks in all (total), free now (free), and "
                      "those requests wait for (awaited).", labels=[*sr, "kind"])
        self.sent = c("pdflow_kv_sent_bytes", "KV bytes a replica wrote over the data plane, by the stage it wrote "
                      "to and the link's transport.", labels=[*sr, "peer", "transport"])
        self.network = c("pdflow_kv_network_bytes", "Of pdflow_kv_sent_bytes, the bytes written to a replica on "
                         "another host: the KV that crossed the network.", labels=[*sr, "peer", "transport"])
        self.store = {key: c(f"pdflow_kv_store_{key}", f"KV store {words}.", labels=sr)
                      for key, words in _STORE_COUNTERS.items()}
        self.tier_hits = c("pdflow_kv_store_hit_bytes", "KV bytes a store served to requests' prefixes, by the tier "
                           "they came from (memory; disk: read back into memory for them).", labels=[*sr, "tier"])
        self.spilled = c("pdflow_kv_store_spilled_bytes", "KV bytes a store wrote to its disk tier.", labels=sr)
        self.tier_bytes = g("pdflow_kv_store_bytes", "KV store bytes per tier, used and capacity.",
                            labels=[*sr, "tier", "kind"])
        self.other = g("pdflow_stage_counter", "Any other counter a replica reports with its heartbeats.",
                       labels=[*sr, "name"])
        vm, ve = ["model_name"], ["model_name", "engine"]
        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.", labels=vm)
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=vm)
        self.usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=ve)
        self.queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                         labels=ve)
        self.hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels=ve)
        self.spec = {key: c(f"vllm:{name}", doc, labels=ve) for key, (name, doc) in _SPEC_COUNTERS.items()}
        self.total_running = self.total_waiting = 0

    def all(self):
        self.running.add_metric([self.model], self.total_running)
        self.waiting.add_metric([self.model], self.total_waiting)
        return (self.configured, self.states, self.in_flight, self.restarts, self.batch, self.steps, self.rows,
                self.pool, self.sent, self.network, *self.store.values(), self.tier_hits, self.spilled, self.tier_bytes, self.other,
                self.running, self.waiting, self.usage, self.queries, self.hits, *self.spec.values())


class StageCollector:
    """The replicas' state and heartbeat counters, as the launcher last reported them."""

    def __init__(self, ingress, model: str) -> None:
        self.ingress = ingress
        self.model = model

    def describe(self):
        return []

    def collect(self):
        pipeline, reports = self.ingress.pipeline, self.ingress.stage_status
        f = _Families(self.model)
        decode_pools = any("pool_blocks" in r.get("stats", {}) for r in reports.values())
        for name, stage in pipeline.stages.items():
            display = stage.display_name
            f.configured.add_metric([display], stage.replicas)
            counts = dict.fromkeys(("ready", "starting", "restarting", "unreported"), 0)
            for replica in range(stage.replicas):
                report = reports.get(f"{display}-{replica}")
                if report is None:
                    counts["unreported"] += 1
                    continue
                counts[report["state"]] = counts.get(report["state"], 0) + 1
                self._replica(f, pipeline, name, [display, str(replica)], report, decode_pools)
            for state, count in counts.items():
                f.states.add_metric([display, state], count)
        yield from f.all()

    def _replica(self, f: _Families, pipeline, name: str, labels: list[str], report: dict,
                 decode_pools: bool) -> None:
        f.in_flight.add_metric(labels, report["in_flight"])
        f.restarts.add_metric(labels, report["restarts"])
        stats = report.get("stats", {})
        engine = [self.model, "-".join(labels)]
        for key, value in stats.items():
            if key.startswith(_SENT_PREFIX):
                peer = key[len(_SENT_PREFIX):]
                f.sent.add_metric([*labels, peer, _transport_of(pipeline, name, peer)], value)
            elif key.startswith(_NETWORK_PREFIX):
                peer = key[len(_NETWORK_PREFIX):]
                f.network.add_metric([*labels, peer, _transport_of(pipeline, name, peer)], value)
            elif key in _STORE_COUNTERS:
                f.store[key].add_metric(labels, value)
            elif key in _STORE_GAUGES:
                f.tier_bytes.add_metric([*labels, *_STORE_GAUGES[key]], value)
            elif key in _SPEC_COUNTERS:
                f.spec[key].add_metric(engine, value)
            elif key in _POOL:
                f.pool.add_metric([*labels, _POOL[key]], value)
            elif key not in _READ:
                f.other.add_metric([*labels, key], value)
        if "batch_size" in stats:
            f.batch.add_metric(labels, stats["batch_size"])
            f.steps.add_metric(labels, stats["decode_steps"])
            f.rows.add_metric(labels, stats["decode_step_rows"])
        f.total_running += stats.get("requests_running", 0)
        f.total_waiting += stats.get("requests_waiting", 0)
        if "queried_tokens" in stats:  # a store
            f.queries.add_metric(engine, stats["queried_tokens"])
            f.hits.add_metric(engine, stats["hit_tokens"])
            per_block = stats["bytes_total"] // max(stats["blocks_total"], 1)
            f.tier_hits.add_metric([*labels, "memory"], stats["hit_blocks"] * per_block)
            if "disk_load_bytes" in stats:
                f.tier_hits.add_metric([*labels, "disk"], stats["disk_load_bytes"])
                f.spilled.add_metric(labels, stats["spill_bytes"])
        if "pool_blocks" in stats:
            f.usage.add_metric(engine, 1.0 - stats["pool_free_blocks"] / max(stats["pool_blocks"], 1))
        elif "blocks_total" in stats and not decode_pools:  # decode attends in this store (or runs colocated)
            f.usage.add_metric(engine, stats["blocks_used"] / max(stats["blocks_total"], 1))
