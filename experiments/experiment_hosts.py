#!/usr/bin/env python
"""The PD pipeline across hosts in three shapes against the same pipeline on one host.

Every configuration runs the same pipeline (ingress, prefill pinned to core 0, kv-shuttle,
decode pinned to core 1; the planes authenticated), each stage started by `pdflow run --node` in
a network namespace (`pdflow.testing.hosts`), what each host sends shaped by tc (tbf) to the
configuration's rate, the hosts joined by veth pairs and a bridge:

- one-host: every stage on one host (its loopback);
- central: ingress, prefill, kv-shuttle and decode on four hosts: the KV crosses two links,
  prefill -> kv-shuttle -> decode (the shape before host locality);
- beside: the store beside prefill on one host, decode on another (three hosts): prefill computes
  into the store's blocks over the host's shm link, the KV crosses one link, store -> decode, and
  decode's answers come back over it (the default multi-host shape, topologies/multi-host.toml);
- direct: beside, with kv.direct: prefill writes into decode's pool itself, and into the store
  behind it.

Measured per configuration:

1. link: what one TCP stream gets between two of its hosts (prefill's and decode's; on one host,
   its loopback): 256 MiB through a socket, as fast as Python sends it;
2. kv-tail: --kv-repeats different --kv-tokens-token prompts: prefill, the whole KV transfer, and
   the KV tail (prefill's last layer computed -> decode holds all KV), from each request's
   timeline, the median of them (and every tail, in the JSON);
3. serve: `pdflow bench serve`, random prompts of --input-range tokens, 32-64 generated, at --rate:
   TTFT and TBT p50/p99, goodput; and each host configuration's figures over one-host's;
4. bytes: over the serve run, the KV the requests move (their prompts' KV, their tokens x the
   model's KV bytes per token, to decode; and their answers' new blocks, which decode writes back
   into the store); the KV bytes the stages wrote to a peer on another host
   (pdflow_kv_network_bytes): the prompts' part over the prompts' KV (its crossings), and all of
   it over the KV moved; and every byte every host sent on its link (its veth's tx_bytes: control
   messages, HTTP, TCP/IP headers too) over the KV moved.

Needs root and iproute2. This machine's kernel has no netem, so latency is not emulated.

    .venv/bin/python experiments/experiment_hosts.py --out bench-results/hosts
    .venv/bin/python experiments/experiment_hosts.py --bandwidths 10gbit --shapes beside --num-prompts 10  # smoke

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json.
"""

from __future__ import annotations

import json
import statistics
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


# stage -> host, per shape; the transports into the store and into decode; the shape's extra tables
BESIDE = {"ingress": "head", "prefill": "prefill", "kv_shuttle": "prefill", "decode": "decode"}
SHAPES = {
    "central": ({"ingress": "head", "prefill": "prefill", "kv_shuttle": "shuttle", "decode": "decode"},
                ("tcp", "tcp"), ""),
    "beside": (BESIDE, ("shm", "tcp"), ""),
    "direct": (BESIDE, ("shm", "tcp"), "[kv]\ndirect = true\n"),
}


def tx_bytes(net: Namespaces, hosts) -> int:
    """Every byte the hosts have sent on their links so far."""
    return sum(int(net.run(host, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=True).stdout)
               for host in hosts)


def kv_counts(cluster: Cluster) -> dict[str, int]:
    """The stages' KV byte counters, summed: on the network, and of those decode's (answers'
    blocks written back to the store); and all decode wrote back."""
    _, body = cluster.health()
    counts = {"network": 0, "answers_network": 0, "answers": 0}
    for name, info in body.get("stages", {}).items():
        for key, value in info.get("stats", {}).items():
            if key.startswith("kv_network_bytes@"):
                counts["network"] += value
                if name.startswith("decode-"):
                    counts["answers_network"] += value
            elif key.startswith("kv_sent_bytes@") and name.startswith("decode-"):
                counts["answers"] += value
    return counts


def run_configuration(opts, name: str, shape: str | None, bandwidth: str | None) -> dict:
    placed, links, extra = SHAPES[shape] if shape else ({stage: "head" for stage in BESIDE}, ("tcp", "tcp"), "")
    names = tuple(dict.fromkeys(placed.values()))
    placement = {stage: [host] for stage, host in placed.items()}
    out = opts.out
    with Namespaces(names, bandwidth=bandwidth) as net, tempfile.TemporaryDirectory() as tmp:
        gbit = link_throughput(net, "prefill", "decode") if shape else link_throughput(net, "head", "head")
        cluster = Cluster(net, Path(tmp), lambda secret: hosts_topology(net, secret, placement, request_timeout_s=900,
                                                                        transports=links, extra=extra))
        for host in names:
            cluster.start(host)
        cluster.wait(lambda status, body: status == 200, f"{name}: every stage ready")
        one_prompt_timeline(cluster.url, 64)  # warm: the first request pays for first-use costs
        timelines = [one_prompt_timeline(cluster.url, opts.kv_tokens, variant) for variant in range(opts.kv_repeats)]
        (out / f"timeline-{name}.json").write_text(json.dumps(timelines))
        argv = ["--dataset", "random", "--input-len-range", opts.input_range, "--output-len-range", "32:64",
                "--num-prompts", str(opts.num_prompts), "--seed", "1", "--request-rate", str(opts.rate),
                "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
        time.sleep(1.5)  # a heartbeat after the timeline's requests
        wire_before, before = tx_bytes(net, names), kv_counts(cluster)
        metrics = bench(cluster.url, out / f"serve-{name}.json", argv)["runs"][0]["metrics"]
        time.sleep(1.5)  # a heartbeat after the last request
        wire, counts = tx_bytes(net, names) - wire_before, kv_counts(cluster)
    prompt_kv = metrics["input_tokens"] * opts.token_kv_bytes
    summaries = [kv_summary(timeline) for timeline in timelines]
    kv = {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}
    kv["kv_tail_all_s"] = [s["kv_tail_s"] for s in summaries]
    return {"link_gbit": gbit, "kv": kv, "serve": metrics,
            "bytes": {"prompt_kv": prompt_kv, "wire": wire, **{key: counts[key] - before[key] for key in counts}}}


def main() -> int:
    p = experiment_parser(__doc__, "hosts")
    p.add_argument("--bandwidths", default="10gbit,25gbit", help="tc rates of the host configurations")
    p.add_argument("--shapes", default="central,beside,direct", help="of " + ", ".join(SHAPES))
    p.add_argument("--kv-tokens", type=int, default=2048, help="the prompts whose KV tail is measured")
    p.add_argument("--kv-repeats", type=int, default=5, help="that many prompts, each another (the median)")
    p.add_argument("--input-range", default="32:512")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.4, help="requests per second")
    add_slo_arguments(p, ttft_ms=5000.0, tbt_ms=300.0)
    opts = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot make network namespaces here: {why}")
    opts.parts = "hosts"
    opts.token_kv_bytes = _token_kv_bytes()
    return REPORT.run("PD across hosts against one host", {"hosts": part_hosts}, opts)


def _token_kv_bytes() -> int:
    """The default model's KV bytes per token (keys and values, every layer), as served."""
    from pdflow import models
    from pdflow.config.topology import load_topology
    from pdflow.kv.layout import KvLayout

    topology = load_topology(Path(__file__).resolve().parents[1] / "topology.toml")
    return KvLayout.from_model_dir(models.model_dir(topology.model.source), topology.model.dtype).request_bytes(1)


def part_hosts(opts, out: Path) -> None:
    configurations = [("one-host", None, None)] + [
        (f"{shape}-{b}", shape, b) for b in opts.bandwidths.split(",") for shape in opts.shapes.split(",")]
    results = {}
    for name, shape, bandwidth in configurations:
        say(f"- {name}")
        results[name] = run_configuration(opts, name, shape, bandwidth)
    (out / "hosts.json").write_text(json.dumps(results))
    say()
    say(f"KV of {opts.kv_repeats} {opts.kv_tokens}-token prompts (medians), and the load: random prompts {opts.input_range} tokens, 32-64 "
        f"generated, {opts.num_prompts} requests at {opts.rate:g} req/s; SLOs TTFT <= {opts.slo_ttft:.0f} ms, "
        f"TBT <= {opts.slo_tbt:.0f} ms. KV moved: the load's prompts' KV ({opts.token_kv_bytes} bytes a token) "
        "and its answers' blocks written back into the store.")
    say()
    say("| configuration | one TCP stream (Gbit/s) | prefill (s) | whole KV transfer (ms) | KV tail (ms, median (range)) | hidden | "
        "TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | TBT p99 (ms) | goodput (req/s) | prompt KV's crossings | "
        "KV on the network / KV moved | every byte sent / KV moved |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        kv, m, b = r["kv"], r["serve"], r["bytes"]
        moved = b["prompt_kv"] + b["answers"]
        say(f"| {name} | {r['link_gbit']:.1f} | {kv['prefill_s']:.2f} | {kv['whole_transfer_s'] * 1e3:.0f} | "
            f"{kv['kv_tail_s'] * 1e3:.1f} ({min(kv['kv_tail_all_s']) * 1e3:.1f}-{max(kv['kv_tail_all_s']) * 1e3:.1f}) | "
            f"{kv['hidden_fraction']:.0%} | {figure(m['ttft_ms']['p50'])} | "
            f"{figure(m['ttft_ms']['p99'])} | {figure(m['tbt_ms']['p50'], '.1f')} | {figure(m['tbt_ms']['p99'], '.1f')} "
            f"| {m['goodput']:.3f} | {(b['network'] - b['answers_network']) / b['prompt_kv']:.3f} | "
            f"{b['network'] / moved:.3f} | {b['wire'] / moved:.3f} |")
    base = results["one-host"]
    say()
    say("Against one host, and against the central store at the same rate (the same run):")
    say()
    say("| configuration | KV tail | TTFT p50 | TTFT p99 | TBT p99 | goodput | KV tail / central's | "
        "KV on the network / central's |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(a, b) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    for name, r in results.items():
        if name == "one-host":
            continue
        m, b = r["serve"], base["serve"]
        central = results.get("central-" + name.split("-", 1)[1])
        say(f"| {name} | {ratio(r['kv']['kv_tail_s'], base['kv']['kv_tail_s'])} | "
            f"{ratio(m['ttft_ms']['p50'], b['ttft_ms']['p50'])} | {ratio(m['ttft_ms']['p99'], b['ttft_ms']['p99'])} | "
            f"{ratio(m['tbt_ms']['p99'], b['tbt_ms']['p99'])} | {ratio(m['goodput'], b['goodput'])} | "
            f"{ratio(r['kv']['kv_tail_s'], central['kv']['kv_tail_s']) if central else '-'} | "
            f"{ratio(r['bytes']['network'], central['bytes']['network']) if central else '-'} |")


if __name__ == "__main__":
    sys.exit(main())
