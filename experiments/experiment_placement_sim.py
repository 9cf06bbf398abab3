#!/usr/bin/env python
"""Where the stores run, at cluster scale, simulated: the capacity of one PD deployment with a
central store, a store beside each prefill host, and the direct path, on a NIC per host.

The same ``--split`` of ``--replicas`` (PD 80:20 with cache-aware routing: the best of
experiments/experiment_pd_vs_colocated_sim.py) with the stores placed (:mod:`pdflow.simulate.network`):

- **central**: ``--central-stores`` store hosts of their own (each count given), every byte of KV
  in and out of one of them: twice across the network, and their NICs carry all of it;
- **beside**: a store on each prefill host, ingress pairing the two: once;
- **direct**: as beside on the network (once); the store's relay it saves costs nothing in this
  fluid model, so its figures equal beside's here (experiments/experiment_hosts.py measures it).

Each is replayed at each ``--speeds`` with each host's NIC at each ``--nic-gbit`` (each way), and
its **capacity** found as in the PD-against-colocated experiment: the load at which ``--attainment``
of requests meet both SLOs (TTFT, Mooncake's TBT), linear between the last speed of the grid that
meets it and the next. Also reported: the KV that crossed the network over the prompts' KV, and
the busiest NIC direction's use over the run.

    .venv/bin/python experiments/experiment_placement_sim.py \\
        --profile profiles/h100x8-llama-3-70b-roofline.json --out bench-results/placement-sim

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


def placements(opts) -> list[tuple[str, dict]]:
    """(name, Deployment fields) of every placement compared."""
    p = int(opts.split.split(":")[0])
    return [*((f"central, {n} store hosts", {"placement": "central", "stores": n}) for n in opts.central_stores),
            ("beside each prefill", {"placement": "beside", "stores": p}),
            ("direct", {"placement": "direct", "stores": p})]


def main() -> int:
    p = experiment_parser(__doc__, "placement-sim")
    p.add_argument("--profile", type=Path, required=True)
    add_trace_argument(p)
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--split", default="80:20", help="prefill:decode")
    p.add_argument("--router", default="cache_aware")
    p.add_argument("--router-option", nargs="+", default=["prefill_tokens_per_s=26000", "fetch_tokens_per_s=150000"],
                   help="the router's options, KEY=VALUE (default: the roofline profile's speeds)")
    p.add_argument("--central-stores", nargs="+", type=int, default=[8, 80], help="store hosts of the central placement")
    p.add_argument("--nic-gbit", nargs="+", type=float, default=[400.0, 100.0], help="each host's NIC, each way")
    p.add_argument("--speeds", nargs="+", type=float, default=[5, 10, 15, 20, 30, 40, 50, 60])
    p.add_argument("--store-blocks", type=int, default=6000)
    p.add_argument("--block-tokens", type=int, default=512)
    add_slo_arguments(p, ttft_ms=2000.0, tbt_ms=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--limit", type=int, default=None, help="only the trace's first N requests")
    opts = p.parse_args()
    prefill, decode = (int(x) for x in opts.split.split(":"))
    if prefill + decode != opts.replicas:
        raise SystemExit(f"--split {opts.split}: {prefill} + {decode} is not --replicas {opts.replicas}")
    options = {k: float(v) for k, v in (o.split("=", 1) for o in opts.router_option)}
    require_trace(opts.trace)
    opts.out.mkdir(parents=True, exist_ok=True)
    profile = Profile.load(opts.profile)
    REPORT.header("Where the stores run, simulated")
    say(f"profile: {profile.name} ({profile.source})")
    say(f"PD {opts.split} of {opts.replicas} replicas, {opts.router} ({', '.join(opts.router_option)}), "
        f"{opts.store_blocks} blocks of {opts.block_tokens} tokens per store; SLOs: TTFT <= {opts.slo_ttft:g} ms, "
        f"TBT (Mooncake's) <= {opts.slo_tbt:g} ms; capacity: the load at which {opts.attainment:.0%} of requests "
        "within both falls through")
    say()
    runs = []
    for nic in opts.nic_gbit:
        for name, fields in placements(opts):
            deployment = Deployment(prefill=prefill, decode=decode, block_tokens=opts.block_tokens,
                                    store_blocks=opts.store_blocks, nic_gbit_per_s=nic, **fields)
            for speed in opts.speeds:
                requests = from_trace(str(opts.trace), limit=opts.limit, speed=speed)
                started = time.perf_counter()
                m = simulate(requests, profile, deployment, opts.router, options, slo_ttft_ms=opts.slo_ttft,
                             slo_tbt_ms=opts.slo_tbt).metrics
                rate = len(requests) / (max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests))
                runs.append({"placement": name, "nic_gbit": nic, "speed": speed, "rate": rate,
                             "attainment": m["goodput_fraction"], "ttft_p50": m["ttft_ms"]["p50"],
                             "ttft_p99": m["ttft_ms"]["p99"], "tbt_p99": m["tbt_mooncake_ms"]["p99"],
                             "network": m["network"], "seconds": time.perf_counter() - started})
                print(f"{name}, {nic:g} Gbit/s, {speed:g}x: {m['goodput_fraction']:.1%} within SLOs "
                      f"({runs[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)
    (opts.out / "runs.json").write_text(json.dumps(runs, indent=1))
    speeds = sorted({r["speed"] for r in runs})
    say("| NIC (Gbit/s, each way) | placement | " + " | ".join(f"{s:g}x" for s in speeds)
        + " | capacity | KV on the network / prompts' KV | busiest NIC at the capacity's speed |")
    say("|---:|---|" + "---|" * len(speeds) + "---:|---:|---|")
    capacity = {}
    for nic in opts.nic_gbit:
        for name, _ in placements(opts):
            mine = sorted((r for r in runs if r["placement"] == name and r["nic_gbit"] == nic), key=lambda r: r["speed"])
            found, how = capacity_at([(r["rate"], r["attainment"]) for r in mine], opts.attainment)
            capacity[(nic, name)] = found or 0.0
            cells = [f"{r['attainment']:.0%}" for r in mine]
            shown = f"{found:.1f} req/s" + (" or more" if how.startswith("at least") else "") if found else how
            near = max((r for r in mine if found is None or r["rate"] <= found + 1e-9), key=lambda r: r["rate"],
                       default=mine[0])
            busy = near["network"]["busiest_nic"]
            busiest = f"prefill {busy['prefill']:.0%}, decode {busy['decode']:.0%}" + \
                (f", store {busy['store']:.0%}" if near["network"]["placement"] == "central" else "")
            say(f"| {nic:g} | {name} | " + " | ".join(cells) + f" | {shown} | "
                f"{near['network']['kv_crossings']:.2f}x | {busiest} ({near['speed']:g}x) |")
    say()
    say("Cells: share of requests within both SLOs at each replay speed.")
    say()
    for nic in opts.nic_gbit:
        one = capacity[(nic, "beside each prefill")]
        for name, _ in placements(opts):
            if name.startswith("central") and capacity[(nic, name)]:
                say(f"- {nic:g} Gbit/s NICs: a store beside each prefill {one:.1f} req/s against {name} "
                    f"{capacity[(nic, name)]:.1f} req/s: {one / capacity[(nic, name)]:.2f}x")
    REPORT.write(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
