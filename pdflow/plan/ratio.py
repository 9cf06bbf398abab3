"""A prefill:decode split for a target load, from what one replica of each can do.

Prefill must compute, every second, ``rate x input tokens x (1 - hit ratio)`` tokens (what the
store does not give); decode must produce ``rate x output tokens``. A replica's throughput is
measured (``pdflow bench engine``, or a stage's own counters under ``pdflow bench serve``) at the
batch that still meets the TBT SLO, and kept below ``utilization`` of it: queueing delay grows
without bound as a server's load nears its capacity (M/M/1: the mean wait is ``rho / (1 - rho)``
service times: 4 at 0.8), so a pool run at 100% has no TTFT to speak of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Split", "split"]


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    decode: int
    prefill_tokens_per_s: float  # what the load asks of prefill (after the store's hits)
    decode_tokens_per_s: float  # what it asks of decode
    prefill_utilization: float  # of the pool suggested
    decode_utilization: float

    @property
    def ratio(self) -> str:
        g = math.gcd(self.prefill, self.decode) or 1
        return f"{self.prefill // g}:{self.decode // g}"


def split(rate: float, input_tokens: float, output_tokens: float, prefill_capacity: float,
          decode_capacity: float, hit_ratio: float = 0.0, utilization: float = 0.8) -> Split:
    """Replicas of each for ``rate`` requests a second of ``input_tokens`` in and
    ``output_tokens`` out (means), given one prefill replica's ``prefill_capacity`` and one decode
    replica's ``decode_capacity`` (tokens a second) and the share of prompt tokens the store gives."""
    for name, value in (("rate", rate), ("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value:g}")
    for name, value in (("prefill_capacity", prefill_capacity), ("decode_capacity", decode_capacity)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 tokens/s, got {value:g}")
    if not 0 <= hit_ratio < 1:
        raise ValueError(f"hit_ratio must be in [0, 1), got {hit_ratio:g}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization:g}")
    prefill_load = rate * input_tokens * (1 - hit_ratio)
    decode_load = rate * output_tokens
    p = max(1, math.ceil(prefill_load / (prefill_capacity * utilization) - 1e-9))
    d = max(1, math.ceil(decode_load / (decode_capacity * utilization) - 1e-9))
    return Split(p, d, prefill_load, decode_load, prefill_load / (p * prefill_capacity),
                 decode_load / (d * decode_capacity))


def capacities_from_engine_report(report: dict, input_tokens: float, tbt_slo_s: float | None = None,
                                  weights: str | None = None) -> tuple[float, float, str]:
    """One replica's prefill and decode throughput (tokens a second) from a ``pdflow bench
    engine --out`` report: prefill at the measured prompt length nearest ``input_tokens``; decode
    at the largest measured batch whose step meets ``tbt_slo_s`` (all of them when None). The
    third item says which measurements were used. ValueError when the report lacks them."""
    formats = report.get("formats") if isinstance(report, dict) else None
    if not formats:
        raise ValueError("not a `pdflow bench engine` report: it has no formats")
    name = weights or next(iter(formats))
    if name not in formats:
        raise ValueError(f"the report has no weight format {name!r}; it has {', '.join(formats)}")
    row = formats[name]
    prefill = {int(k): float(v) for k, v in row.get("prefill", {}).items()}
    decode = {int(k): float(v) for k, v in row.get("decode", {}).items()}
    if not prefill or not decode:
        raise ValueError(f"format {name!r} of the report lacks prefill or decode times")
    length = min(prefill, key=lambda n: abs(n - input_tokens))
    meeting = [b for b, s in decode.items() if tbt_slo_s is None or s <= tbt_slo_s]
    if not meeting:
        raise ValueError(f"no measured decode batch meets a TBT of {tbt_slo_s * 1e3:g} ms "
                         f"(the fastest, batch {min(decode)}, steps in {decode[min(decode)] * 1e3:.1f} ms)")
    batch = max(meeting)
    used = (f"{name} weights: prefill of {length} tokens in {prefill[length] * 1e3:.0f} ms; decode step of "
            f"batch {batch} in {decode[batch] * 1e3:.1f} ms (context {report.get('context', '?')})")
    return length / prefill[length], batch / decode[batch], used
