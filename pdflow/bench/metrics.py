"""Latency distributions, throughput and goodput from a run's request records.

Definitions (latencies in milliseconds):

* TTFT: from sending a request to its first text chunk.
* TBT: every gap between consecutive text chunks, over all requests pooled.
* TBT (Mooncake): per request, the mean of its longest 10 % of gaps (at least one gap), as in
  the Mooncake paper (FAST'25); the distribution is over requests. Goodput's TBT SLO uses this one.
* TPOT: per request, (E2E − TTFT) / (output tokens − 1).
* E2E: from sending a request to the end of its stream.
* Goodput: requests per second that finished without error and met both SLOs (an SLO left unset
  is met by everyone); also as a fraction of all requests sent.
* Prefix cache: prompt tokens the server reports as cached (``usage.prompt_tokens_details.
  cached_tokens``) over all prompt tokens (the hit ratio), the prompt tokens it had to compute,
  and the same ratio for an unbounded cache on the same request sequence
  (:mod:`pdflow.bench.cache_bound`), with the measured ratio as a fraction of that bound.
* Speculative decoding: draft tokens the server reports as accepted and rejected
  (``usage.completion_tokens_details``, OpenAI's predicted-output fields), the acceptance rate,
  and the share of output tokens that came from accepted drafts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.bench.serve_client import RequestRecord

QUANTILES = (50, 90, 99)
ERRORS_KEPT = 5


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Iterable[float], scale: float = 1000.0) -> dict:
    """count, mean, min, p50, p90, p99, max of ``values`` times ``scale`` (seconds → ms);
    the statistics are None when there are no values."""
    xs = [v * scale for v in values]
    stats: dict = {"count": len(xs)}
    keys = ["mean", "min", *(f"p{q}" for q in QUANTILES), "max"]
    if not xs:
        return stats | dict.fromkeys(keys)
    stats |= {"mean": sum(xs) / len(xs), "min": min(xs)}
    stats |= {f"p{q}": percentile(xs, q) for q in QUANTILES}
    return stats | {"max": max(xs)}


def mooncake_tbt(gaps: Sequence[float], fraction: float = 0.1) -> float | None:
    """The mean of the longest ``fraction`` of ``gaps`` (at least one); None without gaps."""
    if not gaps:
        return None
    k = max(1, math.ceil(len(gaps) * fraction))
    return sum(sorted(gaps, reverse=True)[:k]) / k


def tpot(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.e2e_s is None or record.output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tbt_ms: float | None) -> bool:
    if not record.ok:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000 > slo_ttft_ms:
        return False
    tbt = mooncake_tbt(record.gaps_s)
    return slo_tbt_ms is None or tbt is None or tbt * 1000 <= slo_tbt_ms


def cache_summary(records: list[RequestRecord], block_tokens: int) -> dict:
    from pdflow.bench.cache_bound import infinite_cache_hits

    ok = [r for r in records if r.ok]
    prompt = sum(r.usage_prompt_tokens or r.prompt_len for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported)
    bound = infinite_cache_hits(records, block_tokens)
    bound_tokens = sum(bound) if bound is not None else None
    return {
        "block_tokens": block_tokens,
        "reported": len(reported),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "bound_tokens": bound_tokens,
        "bound_ratio": bound_tokens / prompt if bound is not None and prompt else None,
        "of_bound": cached / bound_tokens if bound_tokens else None,
        "cached_per_request": distribution((r.cached_tokens for r in reported), scale=1.0),
    }


def speculation_summary(records: list[RequestRecord]) -> dict | None:
    """Draft tokens the server kept and rejected over the run (None: it reported none)."""
    reported = [r for r in records if r.ok and r.drafts_accepted is not None]
    if not reported:
        return None
    accepted = sum(r.drafts_accepted for r in reported)
    rejected = sum(r.drafts_rejected or 0 for r in reported)
    output = sum(r.output_tokens for r in reported)
    return {"reported": len(reported), "accepted": accepted, "rejected": rejected,
            "acceptance": accepted / (accepted + rejected) if accepted + rejected else 0.0,
            "accepted_per_output_token": accepted / output if output else 0.0}


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tbt_ms: float | None = None, block_tokens: int = 64) -> dict:
    """Every metric of one run; ``duration_s`` runs from the first send to the last reply;
    ``block_tokens``: the server's prefix-cache block, for the unbounded-cache bound."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    good = [r for r in records if meets_slo(r, slo_ttft_ms, slo_tbt_ms)]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    input_tokens = sum(r.usage_prompt_tokens or r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": [f"request {r.index}: {r.error}" for r in failed[:ERRORS_KEPT]],
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "input_token_throughput": per_s(input_tokens),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tbt_ms": slo_tbt_ms,
        "good_requests": len(good),
        "goodput": per_s(len(good)),
        "goodput_fraction": len(good) / len(records) if records else 0.0,
        "ttft_ms": distribution(r.ttft_s for r in ok),
        "tbt_ms": distribution(g for r in ok for g in r.gaps_s),
        "tbt_mooncake_ms": distribution(t for r in ok if (t := mooncake_tbt(r.gaps_s)) is not None),
        "tpot_ms": distribution(t for r in ok if (t := tpot(r)) is not None),
        "e2e_ms": distribution(r.e2e_s for r in ok),
        # consistency: tokens counted by the server vs text chunks seen, and vs what was asked
        "usage_missing": sum(r.usage_completion_tokens is None for r in ok),
        "chunks_differ_from_usage": sum(r.usage_completion_tokens not in (None, r.chunks) for r in ok),
        "output_len_differs": sum(r.output_tokens != r.output_len for r in ok),
        "cache": cache_summary(records, block_tokens),
        "speculation": speculation_summary(records),
    }
