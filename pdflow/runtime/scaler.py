"""The adaptive scaler's policy: from what the pipeline measures, one replica more or fewer.

The launcher calls :meth:`Scaler.decide` every ``scaler.interval_s`` with a :class:`Load`: each
scaled stage's running replicas and their work (prefill: requests held; decode: sequences in
its batch; from their heartbeats), and the TTFT and TBT p90 of the last ``scaler.window_s``
(ingress's heartbeat reports them). It answers
+1 or -1 per stage; the launcher starts a parked replica or drains one (no new requests; stopped
once it holds none). The policy itself keeps only time: since when a stage has been hot or cold,
and when it last changed (see :class:`~pdflow.config.pipeline.ScalerConfig` for the rules).

- prefill is hot on TTFT (a queue of prompts is what TTFT waits in) or its queue per replica;
- decode is hot on TBT or its sequences per replica.

It is a plain object with no clock of its own (``now`` is given), so tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdflow.config.pipeline import ScalerConfig


@dataclass(frozen=True, slots=True)
class StageLoad:
    kind: str  # "prefill" or "decode": which latency it answers for
    running: int  # replicas neither parked nor draining (one still loading counts: it is not started twice)
    work: int  # theirs: requests prefill holds, sequences in decode's batch
    lowest: int  # the fewest it may run
    highest: int  # the most


@dataclass(frozen=True, slots=True)
class Load:
    stages: dict[str, StageLoad]  # by stage name
    ttft_p90_s: float | None = None  # None: no request finished its first token in the window
    tbt_p90_s: float | None = None


@dataclass(slots=True)
class _Trend:
    hot_since: float | None = None
    cold_since: float | None = None
    quiet_until: float = 0.0  # cooldown after a change
    why: str = ""


@dataclass
class Scaler:
    config: ScalerConfig
    trends: dict[str, _Trend] = field(default_factory=dict)

    def decide(self, load: Load, now: float) -> dict[str, tuple[int, str]]:
        """Per stage that should change: +1 or -1, and why in words."""
        decisions = {}
        for stage, sl in load.stages.items():
            trend = self.trends.setdefault(stage, _Trend())
            if now < trend.quiet_until:  # the last change is still taking effect: no evidence counts
                continue
            hot, cold, why = self._judge(sl, load)
            trend.hot_since = (now if trend.hot_since is None else trend.hot_since) if hot else None
            trend.cold_since = (now if trend.cold_since is None else trend.cold_since) if cold else None
            step = 0
            if hot and sl.running < sl.highest and now - trend.hot_since >= self.config.up_after_s:
                step = 1
            elif cold and sl.running > sl.lowest and now - trend.cold_since >= self.config.down_after_s:
                step = -1
            if step:
                decisions[stage] = (step, why)
                trend.hot_since = trend.cold_since = None
                trend.quiet_until = now + self.config.cooldown_s
        return decisions

    def _judge(self, sl: StageLoad, load: Load) -> tuple[bool, bool, str]:
        c = self.config
        if sl.kind == "prefill":
            latency, slo, bound, what = load.ttft_p90_s, c.ttft_slo_ms / 1e3, c.prefill_queue_per_replica, "TTFT"
        else:
            latency, slo, bound, what = load.tbt_p90_s, c.tbt_slo_ms / 1e3, c.decode_queue_per_replica, "TBT"
        per_replica = sl.work / max(sl.running, 1)
        if latency is not None and latency > slo:
            return True, False, f"{what} p90 {latency * 1e3:.0f} ms > SLO {slo * 1e3:.0f} ms"
        if per_replica > bound:
            return True, False, f"{per_replica:.1f} requests per replica > {bound:g}"
        fewer = sl.work / max(sl.running - 1, 1)
        cold = (latency is None or latency < slo / 2) and fewer < bound / 2
        latency_words = "no requests" if latency is None else f"{what} p90 {latency * 1e3:.0f} ms"
        return False, cold, f"{latency_words}, load {sl.work} on {sl.running}"
