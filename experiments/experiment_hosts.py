#!/usr/bin/env python
"""The PD pipeline across hosts against the same pipeline on one host.

Every configuration runs the same pipeline (ingress, prefill pinned to core 0, kv-shuttle,
decode pinned to core 1; the planes authenticated), each stage started by `pdflow run --node` in
a network namespace (`pdflow.testing.hosts`):

- one-host: every stage on one host (its loopback);
- each of --bandwidths: ingress, prefill, kv-shuttle and decode on four hosts joined by veth pairs
  and a bridge, what each host sends shaped by tc to that rate (tbf). So the KV crosses two shaped
  links (prefill -> kv-shuttle -> decode), as it would between machines.

Measured per configuration:

1. link: what one TCP stream gets between two of its hosts (prefill's and kv-shuttle's; on one
   host, its loopback): 256 MiB through a socket, as fast as Python sends it;
2. kv-tail: one --kv-tokens-token prompt: prefill, the whole KV transfer, and the KV tail (prefill's
   last layer computed -> decode holds all KV), from the request's timeline;
3. serve: `pdflow bench serve`, random prompts of --input-range tokens, 32-64 generated, at --rate:
   TTFT and TBT p50/p99, goodput; and each host configuration's figures over one-host's.

Needs root and iproute2. This machine's kernel has no netem, so latency is not emulated.

    .venv/bin/python experiments/experiment_hosts.py --out bench-results/hosts
    .venv/bin/python experiments/experiment_hosts.py --bandwidths 10gbit --num-prompts 10   # a smoke run

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


from pdflow.bench.experiments import Report, add_slo_arguments, bench, experiment_parser, figure, one_prompt_timeline
from pdflow.testing.hosts import Cluster, hosts_topology
from pdflow.testing.netns import Namespaces, unavailable
from pdflow.timeline import kv_summary

REPORT = Report()
say = REPORT.say
SPREAD = ("head", "prefill", "shuttle", "decode")  # the hosts of a spread configuration

_RECEIVER = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = server.accept()
got, began = 0, None
buf = bytearray(1 << 20)
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    began = began or time.perf_counter()
    got += n
print(got, time.perf_counter() - began, flush=True)
"""
_SENDER = """
import socket, sys
data = bytes(1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    for _ in range(int(sys.argv[3])):
        conn.sendall(data)
"""


def link_throughput(net: Namespaces, sender: str, receiver: str, mib: int = 256) -> float:
    """Gbit/s of one TCP stream from ``sender`` to ``receiver`` (hosts of ``net``)."""
    import subprocess

    port = 9876
    proc = net.popen(receiver, [sys.executable, "-c", _RECEIVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        net.run(sender, [sys.executable, "-c", _SENDER, net.address(receiver), str(port), str(mib)], check=True,
                timeout=300)
        got, seconds = proc.stdout.readline().split()
        return int(got) * 8 / float(seconds) / 1e9
    finally:
        proc.kill()
        proc.wait(10)


def run_configuration(opts, name: str, bandwidth: str | None) -> dict:
    spread = bandwidth is not None
    names = SPREAD if spread else ("head",)
    placement = {stage: [host if spread else "head"]
                 for stage, host in zip(("ingress", "prefill", "kv_shuttle", "decode"), SPREAD)}
    out = opts.out
    with Namespaces(names, bandwidth=bandwidth) as net, tempfile.TemporaryDirectory() as tmp:
        gbit = link_throughput(net, "prefill", "shuttle") if spread else link_throughput(net, "head", "head")
        cluster = Cluster(net, Path(tmp), lambda secret: hosts_topology(net, secret, placement,
                                                                        request_timeout_s=900))
        for host in names:
            cluster.start(host)
        cluster.wait(lambda status, body: status == 200, f"{name}: every stage ready")
        one_prompt_timeline(cluster.url, 64)  # warm: the first request pays for first-use costs
        timeline = one_prompt_timeline(cluster.url, opts.kv_tokens)
        (out / f"timeline-{name}.json").write_text(json.dumps(timeline))
        argv = ["--dataset", "random", "--input-len-range", opts.input_range, "--output-len-range", "32:64",
                "--num-prompts", str(opts.num_prompts), "--seed", "1", "--request-rate", str(opts.rate),
                "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
        metrics = bench(cluster.url, out / f"serve-{name}.json", argv)["runs"][0]["metrics"]
        time.sleep(1.5)  # a heartbeat after the last request
        _, body = cluster.health()
        sent = {stage: {key: value for key, value in info.get("stats", {}).items() if key.startswith("kv_sent_bytes@")}
                for stage, info in body.get("stages", {}).items()}
    return {"link_gbit": gbit, "kv": kv_summary(timeline), "serve": metrics, "sent": sent}


def main() -> int:
    p = experiment_parser(__doc__, "hosts")
    p.add_argument("--bandwidths", default="10gbit,25gbit", help="tc rates of the spread configurations")
    p.add_argument("--kv-tokens", type=int, default=2048, help="the prompt whose KV tail is measured")
    p.add_argument("--input-range", default="32:512")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.4, help="requests per second")
    add_slo_arguments(p, ttft_ms=5000.0, tbt_ms=300.0)
    opts = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot make network namespaces here: {why}")
    opts.parts = "hosts"
    return REPORT.run("PD across hosts against one host", {"hosts": part_hosts}, opts)


def part_hosts(opts, out: Path) -> None:
    configurations = [("one-host", None)] + [(f"hosts-{b}", b) for b in opts.bandwidths.split(",")]
    results = {}
    for name, bandwidth in configurations:
        say(f"- {name}")
        results[name] = run_configuration(opts, name, bandwidth)
    (out / "hosts.json").write_text(json.dumps(results))
    say()
    say(f"KV of one {opts.kv_tokens}-token prompt (prefill -> kv-shuttle -> decode), and the load: random prompts "
        f"{opts.input_range} tokens, 32-64 generated, {opts.num_prompts} requests at {opts.rate:g} req/s; SLOs TTFT "
        f"<= {opts.slo_ttft:.0f} ms, TBT <= {opts.slo_tbt:.0f} ms.")
    say()
    say("| configuration | one TCP stream (Gbit/s) | prefill (s) | whole KV transfer (ms) | KV tail (ms) | hidden | "
        "TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | TBT p99 (ms) | goodput (req/s) |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        kv, m = r["kv"], r["serve"]
        say(f"| {name} | {r['link_gbit']:.1f} | {kv['prefill_s']:.2f} | {kv['whole_transfer_s'] * 1e3:.0f} | "
            f"{kv['kv_tail_s'] * 1e3:.1f} | {kv['hidden_fraction']:.0%} | {figure(m['ttft_ms']['p50'])} | "
            f"{figure(m['ttft_ms']['p99'])} | {figure(m['tbt_ms']['p50'], '.1f')} | {figure(m['tbt_ms']['p99'], '.1f')} "
            f"| {m['goodput']:.3f} |")
    base = results["one-host"]
    say()
    say("Against one host (the same run):")
    say()
    say("| configuration | KV tail | TTFT p50 | TTFT p99 | TBT p99 | goodput |")
    say("|---|---:|---:|---:|---:|---:|")

    def ratio(a, b) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    for name, r in results.items():
        if name == "one-host":
            continue
        m, b = r["serve"], base["serve"]
        say(f"| {name} | {ratio(r['kv']['kv_tail_s'], base['kv']['kv_tail_s'])} | "
            f"{ratio(m['ttft_ms']['p50'], b['ttft_ms']['p50'])} | {ratio(m['ttft_ms']['p99'], b['ttft_ms']['p99'])} | "
            f"{ratio(m['tbt_ms']['p99'], b['tbt_ms']['p99'])} | {ratio(m['goodput'], b['goodput'])} |")


if __name__ == "__main__":
    sys.exit(main())
