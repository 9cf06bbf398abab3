#!/usr/bin/env python
"""PD against colocated serving at cluster scale, simulated: the seed's claims (TTFT 50-70% lower,
throughput 2-4x) checked against what ``pdflow simulate`` predicts for a profile and a trace.

For each deployment of the same ``--replicas`` (P:D splits with each ``--routers``; colocated
workers, whole prompts and each ``--chunks``), the trace is replayed at each ``--speeds``. Two
figures, as DistServe defines them:

- **capacity**: the highest load at which at least ``--attainment`` of requests meet both SLOs
  (TTFT, and TBT in Mooncake's definition), in requests per second: linear between the last speed
  on the grid that meets it and the next, which does not; PD's best / the colocated baseline's
  best is the throughput ratio;
- **TTFT** p50 and p99 of each deployment at each speed, and PD's best / colocated's best at the
  speeds where both still meet the attainment.

    .venv/bin/python experiments/experiment_pd_vs_colocated_sim.py \\
        --profile profiles/h100x8-llama-3-70b-roofline.json --out bench-results/pd-vs-colocated-sim

Prints a markdown report (also <out>/summary.md); every run's metrics in <out>/runs.json
(``--from-runs FILE`` reports an earlier run's again, simulating nothing).

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pdflow.bench.experiments import Report, add_slo_arguments, add_trace_argument, experiment_parser, require_trace
from pdflow.simulate.cluster import Deployment
from pdflow.simulate.profile import Profile
from pdflow.simulate.run import capacity as capacity_at, simulate
from pdflow.simulate.workload import from_trace

REPORT = Report()
say = REPORT.say


def deployments(opts) -> list[tuple[str, Deployment, str, dict]]:
    """(name, deployment, router, router options) for every deployment compared."""
    common = {"block_tokens": opts.block_tokens, "store_blocks": opts.store_blocks}
    out = []
    for router in opts.routers:
        options = dict(opts.router_option) if router == "cache_aware" else {}
        for split in opts.splits:
            p, d = (int(x) for x in split.split(":"))
            if p + d != opts.replicas:
                raise SystemExit(f"--splits {split}: {p} + {d} is not --replicas {opts.replicas}")
            out.append((f"PD {split} {router}", Deployment(prefill=p, decode=d, **common), router, options))
    for chunk in [0, *opts.chunks]:
        name = "colocated" + (f" chunked {chunk}" if chunk else "")
        for router in opts.routers:
            options = dict(opts.router_option) if router == "cache_aware" else {}
            out.append((f"{name} {router}", Deployment(mode="colocated", workers=opts.replicas,
                                                        chunked_prefill_tokens=chunk, **common), router, options))
    return out


def pct(pd: float, colocated: float) -> str:
    """How much lower PD's figure is than colocated's, in words."""
    if not colocated:
        return "-"
    change = 1 - pd / colocated
    return f"{change:.0%} lower" if change >= 0 else f"{-change:.0%} higher"


def number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def main() -> int:
    p = experiment_parser(__doc__, "pd-vs-colocated-sim")
    p.add_argument("--profile", type=Path, required=True)
    add_trace_argument(p)
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--splits", nargs="+", default=["60:40", "70:30", "80:20"])
    p.add_argument("--routers", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--router-option", nargs="+", default=["prefill_tokens_per_s=26000",
                                                          "fetch_tokens_per_s=150000"],
                   help="cache_aware's options, KEY=VALUE (default: the roofline profile's speeds)")
    p.add_argument("--chunks", nargs="*", type=int, default=[2048], help="colocated with chunked prefill")
    p.add_argument("--speeds", nargs="+", type=float, default=[10, 20, 30, 40, 50])
    p.add_argument("--store-blocks", type=int, default=6000)
    p.add_argument("--block-tokens", type=int, default=512)
    add_slo_arguments(p, ttft_ms=2000.0, tbt_ms=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--limit", type=int, default=None, help="only the trace's first N requests")
    p.add_argument("--from-runs", type=Path, default=None, help="report this runs.json again, simulating nothing")
    opts = p.parse_args()
    opts.router_option = [(k, number(v)) for k, v in (o.split("=", 1) for o in opts.router_option)]
    if opts.from_runs is None:
        require_trace(opts.trace)
    opts.out.mkdir(parents=True, exist_ok=True)
    profile = Profile.load(opts.profile)
    REPORT.header("PD against colocated, simulated")
    say(f"profile: {profile.name} ({profile.source})")
    say(f"SLOs: TTFT <= {opts.slo_ttft:g} ms, TBT (Mooncake's) <= {opts.slo_tbt:g} ms; capacity: the load at which "
        f"{opts.attainment:.0%} of requests within both falls through")
    say()
    runs = json.loads(opts.from_runs.read_text()) if opts.from_runs else []
    for name, deployment, router, options in [] if opts.from_runs else deployments(opts):
        for speed in opts.speeds:
            requests = from_trace(str(opts.trace), limit=opts.limit, speed=speed)
            started = time.perf_counter()
            outcome = simulate(requests, profile, deployment, router, options, slo_ttft_ms=opts.slo_ttft,
                               slo_tbt_ms=opts.slo_tbt)
            m = outcome.metrics
            rate = len(requests) / (max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests))
            runs.append({"deployment": name, "speed": speed, "rate": rate, "attainment": m["goodput_fraction"],
                         "goodput": m["goodput"], "ttft_p50": m["ttft_ms"]["p50"], "ttft_p99": m["ttft_ms"]["p99"],
                         "tbt_p99": m["tbt_mooncake_ms"]["p99"], "hit": (m["cache"] or {}).get("hit_ratio"),
                         "seconds": time.perf_counter() - started})
            print(f"{name} at {speed:g}x: {m['goodput_fraction']:.1%} within SLOs "
                  f"({runs[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)
    (opts.out / "runs.json").write_text(json.dumps(runs, indent=1))
    speeds = sorted({r["speed"] for r in runs})
    names = list(dict.fromkeys(r["deployment"] for r in runs))
    say("| deployment | " + " | ".join(f"{s:g}x" for s in speeds) + " | capacity |")
    say("|---|" + "---|" * (len(speeds) + 1))
    capacity = {}
    for name in names:
        mine = sorted((r for r in runs if r["deployment"] == name), key=lambda r: r["speed"])
        found, how = capacity_at([(r["rate"], r["attainment"]) for r in mine], opts.attainment)
        capacity[name] = found or 0.0
        cells = [f"{r['attainment']:.0%}, {r['ttft_p50']:,.0f} / {r['ttft_p99']:,.0f}" for r in mine]
        shown = f"{found:.1f} req/s" + (" or more" if how.startswith("at least") else "") if found else how
        say(f"| {name} | " + " | ".join(cells) + f" | {shown} |")
    say()
    say("Cells: share of requests within both SLOs, TTFT p50 / p99 (ms).")
    say()
    pd = max((n for n in names if n.startswith("PD")), key=lambda n: capacity[n])
    colocated = max((n for n in names if n.startswith("colocated")), key=lambda n: capacity[n])
    ratio = capacity[pd] / capacity[colocated] if capacity[colocated] else float("inf")
    say(f"Capacity: best PD ({pd}) {capacity[pd]:.1f} req/s, best colocated ({colocated}) "
        f"{capacity[colocated]:.1f} req/s: {ratio:.2f}x (each linear between two speeds of the grid).")
    for speed in speeds:
        a = next(r for r in runs if r["deployment"] == pd and r["speed"] == speed)
        b = next(r for r in runs if r["deployment"] == colocated and r["speed"] == speed)
        say(f"- at {speed:g}x ({a['rate']:.1f} req/s): TTFT p50 {a['ttft_p50']:,.0f} against {b['ttft_p50']:,.0f} ms "
            f"({pct(a['ttft_p50'], b['ttft_p50'])}), p99 {a['ttft_p99']:,.0f} against "
            f"{b['ttft_p99']:,.0f} ms ({pct(a['ttft_p99'], b['ttft_p99'])}); within SLOs "
            f"{a['attainment']:.0%} against {b['attainment']:.0%}")
    REPORT.write(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
