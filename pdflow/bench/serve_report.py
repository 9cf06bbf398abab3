"""The printed summary of a benchmark: one table per run, and a comparison for a rate sweep."""

from __future__ import annotations

import math

from pdflow.bench.workloads import WorkloadSpec

WIDTH = 78
ROWS = (("TTFT", "ttft_ms"), ("TBT, every gap", "tbt_ms"), ("TBT, Mooncake (per req)", "tbt_mooncake_ms"),
        ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
COLUMNS = ("mean", "p50", "p90", "p99", "max")


def label(rate: float | None, max_concurrency: int | None, spec: WorkloadSpec) -> str:
    if rate is None:
        text = f"trace x{spec.time_scale:g}"
    else:
        text = "rate=inf" if rate == math.inf else f"rate={rate:g}"
    return text + (f" conc={max_concurrency}" if max_concurrency else "")


def _num(value: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def _slo(m: dict) -> str:
    parts = [f"TTFT <= {m['slo_ttft_ms']:g} ms" if m["slo_ttft_ms"] is not None else None,
             f"TBT <= {m['slo_tbt_ms']:g} ms" if m["slo_tbt_ms"] is not None else None]
    return ", ".join(p for p in parts if p) or "no SLO set: every completed request counts"


def table(run_label: str, m: dict, title: str = "pdflow bench serve") -> str:
    usage = m["completed"] - m["usage_missing"]
    lines = [
        f" {title}: {run_label} ".center(WIDTH, "="),
        f"{'requests':<26}{m['requests']} sent, {m['completed']} completed, {m['failed']} failed",
        f"{'duration':<26}{m['duration_s']:.2f} s",
        f"{'request throughput':<26}{m['request_throughput']:.3f} req/s",
        f"{'input tokens':<26}{m['input_tokens']} ({m['input_token_throughput']:.1f} tok/s)",
        f"{'output tokens':<26}{m['output_tokens']} ({m['output_token_throughput']:.1f} tok/s); "
        f"usage on {usage}/{m['completed']}, chunks != usage on {m['chunks_differ_from_usage']}, "
        f"!= max_tokens on {m['output_len_differs']}",
        f"{'goodput':<26}{m['goodput']:.3f} req/s, {100 * m['goodput_fraction']:.1f}% of requests "
        f"({_slo(m)})",
        *_cache_lines(m.get("cache")),
        *_speculation_lines(m.get("speculation")),
        "-" * WIDTH,
        f"{'latency (ms)':<26}" + "".join(f"{c:>9}" for c in COLUMNS) + f"{'count':>8}",
    ]
    for name, key in ROWS:
        d = m[key]
        lines.append(f"{name:<26}" + "".join(_num(d[c]) for c in COLUMNS) + f"{d['count']:>8}")
    if m["errors"]:
        lines.append(f"errors (first {len(m['errors'])} of {m['failed']}):")
        lines += [f"  {e}" for e in m["errors"]]
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"


def _speculation_lines(s: dict | None) -> list[str]:
    if not s:
        return []
    return [f"{'speculative decoding':<26}accepted {100 * s['acceptance']:.1f}% of draft tokens "
            f"({s['accepted']} kept, {s['rejected']} rejected); {100 * s['accepted_per_output_token']:.1f}% of "
            "output tokens came from drafts"]


def _cache_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    if not c["reported"]:
        return [f"{'prefix cache':<26}the server reports no cached tokens"]
    line = (f"{'prefix cache':<26}hit {100 * c['hit_ratio']:.1f}% of prompt tokens "
            f"({c['cached_tokens']} of {c['prompt_tokens']}); computed {c['computed_tokens']}")
    bound = ""
    if c["bound_ratio"] is not None:
        of = f" = {100 * c['of_bound']:.1f}% of it" if c["of_bound"] is not None else ""
        bound = f"{'':<26}unbounded cache ({c['block_tokens']}-token blocks): {100 * c['bound_ratio']:.1f}%{of}"
    d = c["cached_per_request"]
    per = f"{'':<26}cached per request: mean {d['mean']:.0f}, p50 {d['p50']:.0f}, max {d['max']:.0f} tokens"
    return [line] + ([bound] if bound else []) + [per]


def sweep(runs: list[dict]) -> str:
    """Achieved throughput and goodput beside the offered rate, as ratios from the same sweep."""
    head = f"{'run':<22}{'req/s':>9}{'/offered':>9}{'goodput':>9}{'good %':>8}{'TTFT p99':>10}{'TBT-mc p99':>12}"
    lines = [" rate sweep ".center(WIDTH, "="), head]
    for run in runs:
        m, rate = run["metrics"], run["request_rate"]
        ratio = m["request_throughput"] / rate if isinstance(rate, (int, float)) else None
        lines.append(f"{run['label']:<22}{m['request_throughput']:>9.3f}{_num(ratio)}{m['goodput']:>9.3f}"
                     f"{100 * m['goodput_fraction']:>8.1f}{_num(m['ttft_ms']['p99'], 10)}"
                     f"{_num(m['tbt_mooncake_ms']['p99'], 12)}")
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"
