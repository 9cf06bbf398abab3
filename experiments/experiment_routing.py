#!/usr/bin/env python
"""Cache-aware routing against round robin and least loaded, side by side, on this machine.

One pipeline per policy, the same otherwise: two prefill replicas (both on core 0, as the default
topology's one prefill is), two kv-shuttle replicas (two stores, each holding what went through
it), one decode (core 1); a scaled replay of Mooncake's
conversation trace (`pdflow bench serve --dataset trace`), each policy in turn (the order rotating
from repetition to repetition, so none always runs on a fresher machine). Reported per run: the
cached share of prompt tokens (the hit ratio), the blocks stores fetched from each other (cache_aware:
a request sent to a store that holds less of its prefix than another fetches the rest from that one;
cache_aware_no_fetch: it recomputes it), TTFT p50 and p99, goodput under the SLOs; then each
policy's goodput over round robin's, per repetition and as their median.

    .venv/bin/python experiments/experiment_routing.py --out bench-results/routing
    .venv/bin/python experiments/experiment_routing.py --time-scale 16 --repeats 2
    .venv/bin/python experiments/experiment_routing.py --parts fetch   # a prefix fetched against computed

Part fetch: prompts of --fetch-tokens tokens, each sent twice, once computed on one store and then,
one token longer, on the other store, which fetches the prefix from the first: how long the fetch
took (the store's log) against how long prefill took to compute it.

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json.

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from pdflow.bench.experiments import (Report, add_slo_arguments, add_trace_argument, bench, experiment_parser, figure,
                                      require_trace, serving)
from pdflow.testing.server import replicated_ports, replicated_topology

# name -> (router policy, its options)
ROUTERS = {"round_robin": ("round_robin", {}), "least_loaded": ("least_loaded", {}),
           "cache_aware": ("cache_aware", {}),  # a store fetches a prefix another one holds
           "cache_aware_no_fetch": ("cache_aware", {"fetch_tokens_per_s": 0}),
           # every request to the store holding least of its prefix, fetched from the other (part fetch)
           "away": ("pdflow.testing.routers:AwayRouter", {})}
POLICIES = ("round_robin", "least_loaded", "cache_aware_no_fetch", "cache_aware")
REPORT = Report()
say = REPORT.say
REPLICAS = {"prefill": 2, "kv_shuttle": 2, "decode": 1}


def topology(name: str, block_tokens: int, request_timeout_s: float):
    policy, options = ROUTERS[name]
    options = ", ".join(f"{key} = {value!r}" for key, value in options.items())
    tables = f"""
[router]
policy = "{policy}"
options = {{ {options} }}

[kv]
block_tokens = {block_tokens}
"""
    return replicated_topology(REPLICAS, tables, limits={"request_timeout_s": request_timeout_s})


def main() -> int:
    p = experiment_parser(__doc__, "routing")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(ROUTERS)}")
    p.add_argument("--conversations", type=int, default=40, help="conversations sampled from the trace")
    p.add_argument("--token-scale", type=float, default=0.03125, help="trace lengths (and 512-token blocks) times this")
    p.add_argument("--time-scale", type=float, default=16, help="replay this many times faster than the trace")
    add_slo_arguments(p, ttft_ms=10000, tbt_ms=500)
    add_trace_argument(p)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--parts", default="routing", help="routing, fetch (comma-separated)")
    p.add_argument("--fetch-tokens", default="1024,2048,4096", help="prompt lengths of part fetch")
    opts = p.parse_args()
    if "routing" in opts.parts.split(","):
        require_trace(opts.trace)
    return REPORT.run("Cache-aware routing", {"routing": part_routing, "fetch": part_fetch}, opts)


def part_fetch(opts, out: Path) -> None:
    import re

    import httpx

    lengths = [int(n) for n in opts.fetch_tokens.split(",")]
    with serving(topology=topology("away", 64, 900), ports=replicated_ports(REPLICAS)) as server:
        rows = []
        for n in lengths:
            prompt = [(i * 7919 + n) % 40000 + 1000 for i in range(n)]  # plain token ids, no special tokens
            for extra in (0, 1):  # computed on one store, then fetched by the other
                reply = httpx.post(f"{server.url}/v1/completions", timeout=900, json={
                    "model": "smollm2", "prompt": prompt + [5000] * extra, "max_tokens": 1, "temperature": 0}).json()
                rows.append((n, extra, reply["id"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
                time.sleep(1.0)  # the stores report what they hold
        log = server.log_path.read_text()

    def field(request_id: str, event: str, name: str) -> float | None:
        for line in log.splitlines():
            if event in line and request_id in line:
                found = re.search(rf"\b{name}=([0-9.]+)", line)
                return float(found.group(1)) if found else None
        return None

    say("Each prompt computed on one kv-shuttle replica's store, then sent one token longer to the other, "
        "which fetches the prefix from the first (`pdflow.testing.routers:AwayRouter`; tcp, SmolLM2's fp32 KV, "
        "64-token blocks): the fetch (the store's `store.fetched` log: asked to all blocks committed) against "
        "prefill computing the same tokens.")
    say()
    say("| prompt tokens | prefill computing them (s) | blocks fetched | MB | fetch (ms) | tokens/s fetched | "
        "fetch / compute |")
    say("|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        computed = next(r for r in rows if r[0] == n and r[1] == 0)
        fetched = next(r for r in rows if r[0] == n and r[1] == 1)
        prefill_s = field(computed[2], "prefill.done", "seconds")
        ms, nbytes = field(fetched[2], "store.fetched", "ms"), field(fetched[2], "store.fetched", "bytes")
        blocks = field(fetched[2], "store.fetched", "blocks")
        if ms is None or not prefill_s:
            say(f"| {n} | {figure(prefill_s, '.2f')} | - | - | - | - | - |  (cached {fetched[3]}: no fetch logged)")
            continue
        tokens = blocks * 64
        say(f"| {n} | {prefill_s:.2f} | {blocks:.0f} | {nbytes / 1e6:.0f} | {ms:.0f} | {tokens / ms * 1e3:,.0f} | "
            f"{ms / 1e3 / prefill_s:.3f} |")


def part_routing(opts, out: Path) -> None:
    from pdflow.bench.workloads import WorkloadSpec, block_size, reusable_fraction, trace_rows

    policies = opts.policies.split(",")
    unknown = [name for name in policies if name not in ROUTERS]
    if unknown:
        raise SystemExit(f"--policies: {', '.join(unknown)} not one of {', '.join(ROUTERS)}")
    block = block_size(opts.token_scale)
    argv = ["--dataset", "trace", "--dataset-path", str(opts.trace), "--token-scale", str(opts.token_scale),
            "--time-scale", str(opts.time_scale), "--sample-conversations", str(opts.conversations),
            "--seed", str(opts.seed), "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
    rows = trace_rows(WorkloadSpec("trace", path=str(opts.trace), token_scale=opts.token_scale,
                                   sample_conversations=opts.conversations, seed=opts.seed))
    say(f"Mooncake conversation trace: every request of {opts.conversations} conversations picked at random "
        f"({len(rows)} requests over {(rows[-1]['timestamp'] - rows[0]['timestamp']) / 1000:.0f} s, replayed "
        f"{opts.time_scale:g}x faster), token scale {opts.token_scale} (512-token hash blocks become {block} tokens; "
        f"the stores' blocks too); reusable fraction (blocks whose prefix an earlier request sent): "
        f"{reusable_fraction(rows):.1%}. Two prefill and two kv-shuttle replicas, one decode; SLOs TTFT <= "
        f"{opts.slo_ttft:.0f} ms, TBT <= {opts.slo_tbt:.0f} ms (`pdflow bench serve " + " ".join(argv) + "`).")
    say()
    say("| run | policy | requests ok / failed | cached / prompt tokens | blocks fetched (failed fetches) | "
        "TTFT p50 (ms) | TTFT p99 (ms) | goodput (req/s) | goodput / round robin |")
    say("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    results: list[dict[str, dict]] = []
    for run in range(opts.repeats):
        order = policies[run % len(policies):] + policies[:run % len(policies)]
        got = {}
        for policy in order:
            with serving(topology=topology(policy, block, 900), ports=replicated_ports(REPLICAS)) as server:
                got[policy] = bench(server.url, out / f"routing-{policy}-{run}.json", argv)["runs"][0]["metrics"]
                time.sleep(1.5)  # a heartbeat after the last request
                stats = [info.get("stats", {}) for name, info in (server.health() or {}).get("stages", {}).items()
                         if "shuttle" in name]
                got[policy]["fetched_blocks"] = sum(s.get("peer_fetched_blocks", 0) for s in stats)
                got[policy]["fetches_failed"] = sum(s.get("peer_fetches_failed", 0) for s in stats)
        results.append(got)
        for policy in policies:
            m = got[policy]
            base = got.get("round_robin", {}).get("goodput")
            ratio = f"{m['goodput'] / base:.2f}x" if base else "-"
            hit = f"{m['cache']['hit_ratio']:.1%}" if m["cache"]["reported"] else "-"
            say(f"| {run + 1} | {policy} | {m['completed']} / {m['failed']} | {hit} | "
                f"{m['fetched_blocks']} ({m['fetches_failed']}) | {figure(m['ttft_ms']['p50'])} "
                f"| {figure(m['ttft_ms']['p99'])} | {m['goodput']:.3f} | {ratio} |")
    (out / "routing.json").write_text(json.dumps(results))
    say()
    if "round_robin" in policies:
        for policy in policies:
            ratios = [r[policy]["goodput"] / r["round_robin"]["goodput"] for r in results if r["round_robin"]["goodput"]]
            if ratios and policy != "round_robin":
                spread = f" (runs: {', '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
                say(f"- goodput {policy} / round robin: **{statistics.median(ratios):.2f}x**{spread}")


if __name__ == "__main__":
    sys.exit(main())
