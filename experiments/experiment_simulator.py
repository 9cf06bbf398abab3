#!/usr/bin/env python
"""Does the simulator predict this machine? The same requests, for real and simulated.

1. profile: ``pdflow profile`` measures this machine's stage costs (or ``--profile FILE``).
2. For each workload, a real PD pipeline (the default topology: prefill on core 0, decode on core
   1) serves ``pdflow bench serve``'s requests; then the simulator replays the *same* requests (the
   arrival times, prompt and output lengths the load generator recorded, and the prompts' 64-token
   blocks, hashed as the store hashes them) through one prefill, one store and one decode with that
   profile. Side by side: TTFT p50/p99, TBT p50/p99 (every gap) and Mooncake's, goodput, hit ratio,
   and simulated / measured.

   mixed: random prompts of 128-1,024 tokens, 32-64 out, Poisson at each ``--rates``; no reuse.
   trace: the Mooncake conversation trace scaled (``--token-scale``, ``--time-scale``): reuse.
   colocated: the mixed load through the colocated worker (both cores, ``--colocated-profile``,
   measured with ``pdflow profile --threads 2``), real and simulated.

    .venv/bin/python experiments/experiment_simulator.py --out bench-results/simulator
    .venv/bin/python experiments/experiment_simulator.py --parts mixed --rates 0.5,1 --num-prompts 40

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json. ``--resimulate``
simulates again what an earlier run in <out> measured (its serve-*.json and profiles), measuring
nothing: for a changed simulator.

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pdflow.bench.experiments import (Report, add_slo_arguments, add_trace_argument, bench, experiment_parser, figure,
                                      require_trace, serving)
from pdflow.kv.blocks import BlockHasher
from pdflow.simulate.cluster import Deployment
from pdflow.simulate.profile import Profile
from pdflow.simulate.run import simulate
from pdflow.simulate.workload import SimRequest

BLOCK = 64  # the store's kv.block_tokens in the default topology
REPORT = Report()
say = REPORT.say


def requests_of(run: dict) -> list[SimRequest]:
    """The requests a bench run sent, as the simulator takes them (failed ones left out)."""
    hasher = BlockHasher("sim", "", BLOCK)
    requests = []
    for record in run["records"]:
        if record.get("error"):
            continue
        tokens = record.get("usage_prompt_tokens") or record["prompt_len"]
        prompt = record.get("prompt")
        if isinstance(prompt, list):
            ids = hasher.ids(prompt)
        else:  # no saved prompt: nothing shared with any other request
            ids = [10**12 + 10**4 * record["index"] + k for k in range(-(-tokens // BLOCK))]
        requests.append(SimRequest(len(requests), record["scheduled_s"], tokens, record["output_tokens"], ids))
    return requests


METRICS = [("TTFT p50 ms", lambda m: m["ttft_ms"]["p50"]), ("TTFT p99 ms", lambda m: m["ttft_ms"]["p99"]),
           ("TBT p50 ms", lambda m: m["tbt_ms"]["p50"]), ("TBT p99 ms", lambda m: m["tbt_ms"]["p99"]),
           ("Mooncake TBT p99 ms", lambda m: m["tbt_mooncake_ms"]["p99"]), ("goodput req/s", lambda m: m["goodput"]),
           ("hit ratio", lambda m: m["cache"]["hit_ratio"])]


def compare(name: str, run: dict, profile: Profile, slo_ttft: float, slo_tbt: float,
            deployment: Deployment = Deployment(1, 1, block_tokens=BLOCK), seeds: int = 1) -> dict:
    """The run beside its simulation; with ``seeds`` > 1 (a profile with gap ratios draws), the
    median of that many simulations and their range."""
    requests = requests_of(run)
    sims = [simulate(requests, profile, deployment, slo_ttft_ms=slo_ttft, slo_tbt_ms=slo_tbt, seed=seed).metrics
            for seed in range(seeds)]
    real = run["metrics"]
    say(f"**{name}** ({len(requests)} requests)")
    say()
    spread = seeds > 1
    say("| metric | measured | simulated | simulated / measured |" + (f" range over {seeds} seeds |" if spread else ""))
    say("|---|---:|---:|---:|" + ("---:|" if spread else ""))
    for metric, get in METRICS:
        measured, values = get(real), sorted(v for v in map(get, sims) if v is not None)
        simulated = statistics.median(values) if values else None
        ratio = simulated / measured if measured and simulated is not None else None
        form = ".3f" if metric.startswith(("good", "hit")) else ".1f"
        cells = f"| {metric} | {figure(measured, form)} | {figure(simulated, form)} | {figure(ratio, '.2f')} |"
        if spread:
            cells += (f" {values[0] / measured:.2f}-{values[-1] / measured:.2f} |" if measured and values else " - |")
        say(cells)
    say()
    return {"name": name, "measured": real, "simulated": sims[0], "simulated_seeds": sims}


def measured(out: Path, name: str, url_argv: tuple[str, list[str]] | None) -> dict:
    """``pdflow bench serve``'s results: run now against ``url_argv`` (url, argv), or read back."""
    if url_argv is None:
        return json.loads((out / name).read_text())
    return bench(url_argv[0], out / name, url_argv[1])


def main() -> int:
    p = experiment_parser(__doc__, "simulator")
    p.add_argument("--profile", type=Path, default=None, help="use this profile instead of measuring one")
    p.add_argument("--parts", default="mixed,trace,colocated")
    p.add_argument("--resimulate", action="store_true", help="simulate <out>'s measured runs again")
    p.add_argument("--seeds", type=int, default=5,
                   help="simulations per run (a profile's gap ratios are drawn; median and range; default: %(default)s)")
    p.add_argument("--colocated-profile", type=Path, default=None,
                   help="the colocated worker's profile (default: measure one with --threads 2)")
    p.add_argument("--rates", default="0.5,1,1.5")
    p.add_argument("--num-prompts", type=int, default=60)
    add_slo_arguments(p, ttft_ms=4000.0, tbt_ms=100.0)
    add_trace_argument(p)
    p.add_argument("--trace-limit", type=int, default=200)
    p.add_argument("--conversations", type=int, default=0,
                   help="trace: every request of this many conversations picked at random (0: the first requests)")
    p.add_argument("--token-scale", type=float, default=0.05)
    p.add_argument("--time-scale", type=float, default=2.0)
    opts = p.parse_args()
    if "trace" in opts.parts.split(",") and not opts.resimulate:
        require_trace(opts.trace)
    opts.out.mkdir(parents=True, exist_ok=True)
    REPORT.header("The simulator against this machine")
    profile_path = opts.profile or opts.out / "profile.json"
    if opts.profile is None and not opts.resimulate:
        say(f"measuring: pdflow profile --out {profile_path}")
        subprocess.run([str(Path(sys.executable).parent / "pdflow"), "profile", "--out", str(profile_path)],
                       check=True)
    profile = Profile.load(profile_path)
    say(f"profile: {profile.name} ({profile.source})")
    say()
    results = []
    parts = opts.parts.split(",")
    slos = ["--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
    if "mixed" in parts or "trace" in parts:
        with contextlib.ExitStack() as stack:
            server = None if opts.resimulate else stack.enter_context(serving())
            if "mixed" in parts:
                argv = ["--dataset", "random", "--input-len-range", "128:1024", "--output-len-range", "32:64",
                        "--num-prompts", str(opts.num_prompts), "--seed", "1", "--request-rate", opts.rates, *slos]
                mixed = measured(opts.out, "serve-mixed.json", server and (server.url, argv))
                for rate, run in zip(opts.rates.split(","), mixed["runs"]):
                    results.append(compare(f"mixed, {rate} req/s", run, profile, opts.slo_ttft, opts.slo_tbt,
                                           seeds=opts.seeds))
            if "trace" in parts:
                picked = (["--sample-conversations", str(opts.conversations), "--seed", "1"]
                          if opts.conversations else [])
                argv = ["--dataset", "trace", "--dataset-path", str(opts.trace), "--limit", str(opts.trace_limit), *picked,
                        "--token-scale", str(opts.token_scale), "--time-scale", str(opts.time_scale), "--save-prompts",
                        *slos]
                trace = measured(opts.out, "serve-trace.json", server and (server.url, argv))
                which = (f"{opts.conversations} conversations" if opts.conversations
                         else f"first {opts.trace_limit} requests")
                results.append(compare(f"conversation trace, {which}, tokens x{opts.token_scale:g}, "
                                       f"{opts.time_scale:g}x speed", trace["runs"][0], profile, opts.slo_ttft,
                                       opts.slo_tbt, seeds=opts.seeds))
    if "colocated" in parts:
        colocated_path = opts.colocated_profile or opts.out / "profile-2-threads.json"
        if opts.colocated_profile is None and not opts.resimulate:
            say(f"measuring: pdflow profile --threads 2 --out {colocated_path}")
            subprocess.run([str(Path(sys.executable).parent / "pdflow"), "profile", "--threads", "2", "--out",
                            str(colocated_path)], check=True)
        colocated = Profile.load(colocated_path)
        say(f"colocated profile: {colocated.name} ({colocated.source})")
        say()
        argv = ["--dataset", "random", "--input-len-range", "128:1024", "--output-len-range", "32:64",
                "--num-prompts", str(opts.num_prompts), "--seed", "1", "--request-rate", opts.rates, *slos]
        if opts.resimulate:
            runs = measured(opts.out, "serve-colocated.json", None)
        else:
            with serving(mode="colocated") as server:
                runs = measured(opts.out, "serve-colocated.json", (server.url, argv))
        for rate, run in zip(opts.rates.split(","), runs["runs"]):
            results.append(compare(f"colocated worker, mixed, {rate} req/s", run, colocated, opts.slo_ttft,
                                   opts.slo_tbt, Deployment(mode="colocated", block_tokens=BLOCK), seeds=opts.seeds))
    (opts.out / "comparison.json").write_text(json.dumps(results, indent=1))
    REPORT.write(opts.out / "summary.md")
    say(f"written: {opts.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
