"""``pdflow simulate``: a trace or a synthetic load through a simulated deployment, with pdflow's own
routers and scaler, reported as ``pdflow bench serve`` reports a real run.

    pdflow simulate --profile profiles/h100-llama3-70b.json --trace ../shared/traces/conversation_trace.jsonl \\
        --prefill 8 --decode 8 --router cache_aware --slo-ttft 2000 --slo-tbt 100
    pdflow simulate --profile my-machine.json --synthetic 500 --rate 2 --input 1024 --output 64 --prefill 1 --decode 1
    pdflow simulate ... --sweep 2:6 4:4 6:2        (P:D splits of the same replicas, side by side)
    pdflow simulate ... --mode colocated --workers 8 [--chunked-prefill-tokens 512]   (the baseline)
    pdflow simulate ... --placement central --stores 4 --nic-gbit 400   (where the KV crosses the network)

Traces are Mooncake's (github.com/kvcache-ai/Mooncake, FAST25-release/traces/, Apache License 2.0):
    curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdflow.bench import traces
from pdflow.simulate.network import PLACEMENTS

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, type=Path, help="stage costs: a `pdflow profile` file or one "
                   "written for another machine (profiles/ ships examples)")
    load = p.add_argument_group("load (one of)")
    load.add_argument("--trace", help=traces.help_text())
    load.add_argument("--synthetic", type=int, metavar="N", help="N Poisson arrivals (with --rate, --input, --output)")
    load.add_argument("--limit", type=int, default=None, help="only the trace's first N requests")
    load.add_argument("--speed", type=float, default=1.0, help="replay the trace this many times as fast (default 1)")
    load.add_argument("--token-scale", type=float, default=1.0, help="scale every trace length (default 1)")
    load.add_argument("--rate", type=float, default=1.0, help="synthetic: requests per second (default 1)")
    load.add_argument("--input", type=int, default=1024, help="synthetic: prompt tokens (default 1024)")
    load.add_argument("--output", type=int, default=128, help="synthetic: output tokens (default 128)")
    load.add_argument("--shared-prefix", type=int, default=0, help="synthetic: tokens every prompt shares (default 0)")
    load.add_argument("--seed", type=int, default=0,
                      help="synthetic arrivals' and a profile's gap ratios' draws (default 0)")
    dep = p.add_argument_group("deployment")
    dep.add_argument("--prefill", type=int, default=1, help="prefill replicas (the most, with --min-prefill)")
    dep.add_argument("--decode", type=int, default=1, help="decode replicas (the most, with --min-decode)")
    dep.add_argument("--sweep", nargs="+", metavar="P:D", help="several prefill:decode splits, side by side")
    dep.add_argument("--stores", type=int, default=None, help="kv-shuttle replicas (default: one per prefill)")
    dep.add_argument("--store-blocks", type=int, default=None, help="blocks each store holds (default: no limit)")
    dep.add_argument("--block-tokens", type=int, default=None,
                     help="tokens per block (default: the trace's 512 x --token-scale; 64 synthetic)")
    dep.add_argument("--kv-streaming", choices=("layer", "request"), default="layer")
    dep.add_argument("--placement", choices=PLACEMENTS, default=None,
                     help="where the stores run, with a NIC per host: central (hosts of their own: the KV crosses "
                          "twice), beside (one per prefill host: once), direct (kv.direct: once); default: only "
                          "prefill's and decode's links are modelled")
    dep.add_argument("--nic-gbit", type=float, default=None, metavar="GBIT",
                     help="each host's NIC, each way, with --placement (default: the profile's link)")
    dep.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated",
                     help="colocated: --workers replicas of pdflow's worker stage (prefill and decode in one) instead")
    dep.add_argument("--workers", type=int, default=1, help="colocated: worker replicas (default 1)")
    dep.add_argument("--chunked-prefill-tokens", type=int, default=0,
                     help="colocated: prompt tokens of prefill per iteration at most (default 0: whole prompts)")
    dep.add_argument("--router", default="round_robin", help="a pdflow router policy or module:Class "
                     "(default: round_robin)")
    dep.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the router (a number or a string); repeatable")
    dep.add_argument("--min-prefill", type=int, default=None, help="scale prefill from this many up to --prefill")
    dep.add_argument("--min-decode", type=int, default=None, help="scale decode from this many up to --decode")
    dep.add_argument("--scaler-option", action="append", default=[], metavar="KEY=VALUE",
                     help="a [scaler] setting (e.g. ttft_slo_ms=2000); repeatable")
    out = p.add_argument_group("report")
    out.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO for goodput")
    out.add_argument("--slo-tbt", type=float, default=None, metavar="MS", help="TBT SLO (Mooncake's, per request)")
    out.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")
    out.add_argument("--plot-dir", type=Path, default=None, help="latency CDFs (and replicas over time) here")


def _options(pairs: list[str], what: str) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _splits(args) -> list[tuple[int, int]]:
    if args.mode == "colocated":
        if args.sweep:
            raise ValueError("--sweep is for P:D splits; with --mode colocated give --workers")
        return [(args.workers, 0)]
    if not args.sweep:
        return [(args.prefill, args.decode)]
    splits = []
    for text in args.sweep:
        p, sep, d = text.partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--sweep {text!r}: expected P:D, two integers >= 1")
        splits.append((int(p), int(d)))
    return splits


def main(args: argparse.Namespace) -> int:
    from pdflow.bench.serve_report import table
    from pdflow.simulate import workload
    from pdflow.simulate.cluster import Deployment
    from pdflow.simulate.profile import Profile
    from pdflow.simulate.run import simulate

    try:
        profile = Profile.load(args.profile)
        if (args.trace is None) == (args.synthetic is None):
            raise ValueError("give one load: --trace FILE or --synthetic N")
        if args.trace:
            requests = workload.from_trace(args.trace, args.limit, args.speed, args.token_scale)
            block = args.block_tokens or max(1, round(512 * args.token_scale))
        else:
            block = args.block_tokens or 64
            requests = workload.synthetic(args.synthetic, args.rate, args.input, args.output, args.shared_prefix,
                                          block, args.seed)
        router_options = _options(args.router_option, "--router-option")
        scaler = None
        if args.min_prefill is not None or args.min_decode is not None:
            from pdflow.config.pipeline import ScalerConfig

            scaler = ScalerConfig(**_options(args.scaler_option, "--scaler-option"))
        splits = _splits(args)
    except (ValueError, OSError, TypeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    runs = []
    for p, d in splits:
        try:
            deployment = Deployment(p, max(d, 1), args.stores, args.store_blocks, block, args.kv_streaming,
                                    args.min_prefill, args.min_decode, args.mode, args.workers,
                                    args.chunked_prefill_tokens, args.placement, args.nic_gbit)
        except ValueError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 2
        started = time.perf_counter()
        try:
            outcome = simulate(requests, profile, deployment, args.router, router_options, scaler,
                               args.slo_ttft, args.slo_tbt, args.seed)
        except (ValueError, TypeError, LookupError) as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 2
        took = time.perf_counter() - started
        shape = f"{p} workers (colocated)" if args.mode == "colocated" else f"{p}P:{d}D"
        label = f"{shape}, {args.router}, {profile.name}"
        sys.stdout.write(table(label, outcome.metrics, "pdflow simulate"))
        if "network" in outcome.metrics:
            sys.stdout.write(_network_lines(outcome.metrics["network"]))
        sys.stdout.write(f"simulated {len(requests):,} requests on {p + d} replicas in {took:.1f} s\n")
        runs.append({"label": shape, "prefill": p, "decode": d, "router": args.router, "seconds": took,
                     "metrics": outcome.metrics,
                     "replicas": outcome.replicas, "records": outcome.records})
    if len(runs) > 1:
        sys.stdout.write(_sweep_table(runs))
    if args.json:
        args.json.write_text(json.dumps({"profile": profile.name, "requests": len(requests),
                                         "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs]},
                                        indent=2))
    if args.plot_dir:
        _plots(runs, args.plot_dir)
    return 0


def _network_lines(net: dict) -> str:
    busy = net["busiest_nic"]
    return (f"network ({net['placement']}): {net['kv_network_bytes'] / 1e9:,.1f} GB of KV crossed it, "
            f"{net['kv_crossings']:.2f}x the prompts' KV; busiest NIC (one way, over the run): prefill host "
            f"{busy['prefill']:.0%}, decode host {busy['decode']:.0%}"
            + (f", store host {busy['store']:.0%}" if net["placement"] == "central" else "") + "\n")


def _sweep_table(runs: list[dict]) -> str:
    lines = [f"{'P:D':>7} {'goodput':>9} {'of reqs':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'TBT p99':>9} "
             f"{'hit':>6}"]
    for r in runs:
        m = r["metrics"]
        lines.append(f"{r['prefill']:>3}:{r['decode']:<3} {m['goodput']:>9.3f} {m['goodput_fraction']:>8.1%} "
                     f"{m['ttft_ms']['p50'] or 0:>10.0f} {m['ttft_ms']['p99'] or 0:>10.0f} "
                     f"{m['tbt_mooncake_ms']['p99'] or 0:>9.1f} {m['cache']['hit_ratio']:>6.1%}")
    return "\n".join(lines) + "\n"


def _plots(runs: list[dict], folder: Path) -> None:
    from pdflow.bench import plots

    if not plots.available():
        sys.stderr.write("warning: no plots: matplotlib is not installed\n")
        return
    folder.mkdir(parents=True, exist_ok=True)
    cdf_runs = [{"label": r["label"],
                 "records": [{"ttft_s": x.ttft_s, "gaps_s": x.gaps_s, "e2e_s": x.e2e_s, "error": x.error}
                             for x in r["records"]]} for r in runs]
    path = plots.plot_cdfs(cdf_runs, folder / "simulated-cdfs.png")
    sys.stdout.write(f"plot: {path}\n")
