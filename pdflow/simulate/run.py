"""One simulation, start to end: requests through a :class:`~pdflow.simulate.cluster.Cluster`,
and the same metrics ``pdflow bench serve`` reports of a real run (:mod:`pdflow.bench.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.bench.metrics import summarize
from pdflow.bench.serve_client import RequestRecord
from pdflow.simulate.cluster import Cluster, Deployment
from pdflow.simulate.profile import Profile
from pdflow.simulate.workload import SimRequest

__all__ = ["Outcome", "capacity", "records_of", "simulate"]


@dataclass
class Outcome:
    metrics: dict  # as pdflow.bench.metrics.summarize gives for a real run
    records: list[RequestRecord]
    replicas: list[tuple[float, int, int]]  # (time, prefill running, decode running) at each scaler tick
    cluster: Cluster


def records_of(requests: list[SimRequest]) -> list[RequestRecord]:
    """Each simulated request as the load generator would have recorded it."""
    records = []
    for r in requests:
        record = RequestRecord(r.index, r.input_len, r.output_len, scheduled_s=r.arrival_s, sent_s=r.arrival_s)
        if r.done_s is None:
            record.error = "not finished when the simulation ended"
        else:
            record.ttft_s = r.first_token_s - r.arrival_s
            record.gaps_s = r.gaps
            record.e2e_s = r.done_s - r.arrival_s
            record.output_tokens = record.chunks = record.usage_completion_tokens = r.output_len
            record.usage_prompt_tokens, record.cached_tokens = r.input_len, r.cached_tokens
            record.finish_reason = "length"
        records.append(record)
    return records


def simulate(requests: list[SimRequest], profile: Profile, deployment: Deployment, router: str = "round_robin",
             router_options: dict | None = None, scaler=None, slo_ttft_ms: float | None = None,
             slo_tbt_ms: float | None = None, seed: int = 0) -> Outcome:
    """Run ``requests`` (replayed afresh: their outcomes are reset) through ``deployment``;
    ``router``: a pdflow router policy (or "module:Class") with ``router_options``; ``scaler``: a
    :class:`~pdflow.config.pipeline.ScalerConfig` (with ``deployment.min_prefill`` /
    ``min_decode``) or None; ``seed``: the draws of a profile's gap ratios."""
    from pdflow.routing import create
    from pdflow.runtime.scaler import Scaler

    for r in requests:
        r.cached_tokens = r.fetched_tokens = 0
        r.first_token_s = r.done_s = r.kv_in_s = None
        r.gaps = []
    cluster = Cluster(profile, deployment, create(router, router_options),
                      Scaler(scaler) if scaler is not None else None, seed)
    cluster.run(requests, scaler.interval_s if scaler is not None else 1.0)
    records = records_of(requests)
    done = [r.done_s for r in requests if r.done_s is not None]
    duration = (max(done) - min(r.arrival_s for r in requests)) if done else 0.0
    metrics = summarize(records, duration, slo_ttft_ms, slo_tbt_ms, deployment.block_tokens)
    if cluster.network is not None:
        metrics["network"] = cluster.network.stats(duration)
    return Outcome(metrics, records, cluster.replica_log, cluster)


def capacity(points: list[tuple[float, float]], attainment: float = 0.9) -> tuple[float | None, str]:
    """The load at which the share of requests within the SLOs falls through ``attainment``, from
    ``points`` of (load, share) of runs at several loads: linear between the last load that keeps
    it and the next, which does not. Returns the load (None: not even the lowest keeps it) and how
    it was found."""
    points = sorted(points)
    if not points:
        raise ValueError("no runs to find a capacity in")
    if points[0][1] < attainment:
        return None, f"below {points[0][0]:.1f} (the lowest load run)"
    for (low, kept), (high, lost) in zip(points, points[1:]):
        if lost < attainment:
            return low + (kept - attainment) / (kept - lost) * (high - low), "between two loads run"
    return points[-1][0], "at least (the highest load run)"
