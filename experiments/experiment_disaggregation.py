#!/usr/bin/env python
"""Does disaggregation pay on this machine? One command, minutes on 2 cores.

1. serve: PD (prefill pinned to core 0, decode to core 1) against the colocated worker on the
   same two cores, without and with chunked prefill, under a mixed load of short and long prompts
   swept over request rates. Reports TTFT/TBT percentiles and goodput under the stated SLOs, as
   ratios from the same run, and draws the designs side by side (compare.png).
   trace: the same three designs on a scaled replay of the Mooncake conversation trace.
2. kv-tail: PD with kv_streaming = "layer" against "request" at 2K- and 8K-token prompts through
   an emulated link slow enough that the transfer is a large part of prefill.
3. overhead: decode tokens/s through the whole PD pipeline against the bare engine's decode loop
   at the same batch size, and how long a token takes from decode to the client.
   hops: that last figure with tokens straight to ingress (the default) against through an
   egress stage, taken at the client's socket and after httpx's parse.

    .venv/bin/python experiments/experiment_disaggregation.py --out bench-results/experiment
    .venv/bin/python experiments/experiment_disaggregation.py --parts kv-tail,overhead --quick

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json, plots to <out>/.

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from pdflow.bench.experiments import (Report, add_slo_arguments, add_trace_argument, bench, experiment_parser, figure,
                                      one_prompt_timeline, require_trace, serving)
from pdflow.timeline import kv_summary, plot

DESIGNS = {
    "pd": {},
    "colocated": {"mode": "colocated"},
    "colocated-chunked": {"mode": "colocated", "chunked_prefill_tokens": 256},
}
REPORT = Report()
say, _f, _bench = REPORT.say, figure, bench


# --- 1. serve ----------------------------------------------------------------------------------


def _designs(out: Path, name: str, argv: list[str], plot: bool) -> dict[str, dict]:
    """Run ``pdflow bench serve`` with ``argv`` against each design, one after another."""
    results = {}
    for design, config in DESIGNS.items():
        with serving(**config) as server:
            say(f"- {design}: {name}")
            plots = ["--plot-dir", str(out / f"plots-{design}-{name}")] if plot else []
            results[design] = _bench(server.url, out / f"serve-{design}-{name}.json", argv + plots)
    return results


def part_serve(opts, out: Path) -> None:
    rates = opts.rates
    mixed = ["--dataset", "random", "--input-len-range", opts.input_range, "--output-len-range", "32:64",
             "--num-prompts", str(opts.num_prompts), "--seed", "1", "--request-rate", rates,
             "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
    repeats = []
    for rep in range(opts.repeats):
        say(f"- repetition {rep + 1} of {opts.repeats}")
        repeats.append(_designs(out, f"mixed-{rep + 1}", mixed, plot=rep == 0))
    from pdflow.bench.plots import plot_compare

    plot_compare({design: repeats[0][design]["runs"] for design in DESIGNS}, out / "compare.png")
    say()
    say(f"Mixed load: random input {opts.input_range} tokens, output 32-64, {opts.num_prompts} requests "
        f"per rate, {opts.repeats} repetitions; SLOs: TTFT <= {opts.slo_ttft:.0f} ms, TBT (Mooncake: mean of "
        f"the longest 10% gaps of a request) <= {opts.slo_tbt:.0f} ms")
    say()
    say("| rep | rate | design | TTFT p50 | TTFT p99 | TBT p50 | TBT p99 | Mooncake TBT p99 | goodput (req/s) | good |")
    say("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for rep, results in enumerate(repeats, 1):
        for i, rate in enumerate(rates.split(",")):
            for design in DESIGNS:
                m = results[design]["runs"][i]["metrics"]
                say(f"| {rep} | {rate} | {design} | {_f(m['ttft_ms']['p50'])} | {_f(m['ttft_ms']['p99'])} | "
                    f"{_f(m['tbt_ms']['p50'])} | {_f(m['tbt_ms']['p99'])} | {_f(m['tbt_mooncake_ms']['p99'])} | "
                    f"{m['goodput']:.3f} | {m['goodput_fraction']:.0%} |")
    say()
    say("Ratios (colocated / PD for TBT p99, PD / colocated for goodput): the median of the repetitions, "
        "and their range:")
    say()
    say("| rate | vs | TBT p99 ratio | Mooncake TBT p99 ratio | goodput ratio |")
    say("|---|---|---|---|---|")
    for i, rate in enumerate(rates.split(",")):
        for design in ("colocated", "colocated-chunked"):
            cells = []
            for key in ("tbt_ms", "tbt_mooncake_ms", "goodput"):
                values = []
                for results in repeats:
                    pd, m = results["pd"]["runs"][i]["metrics"], results[design]["runs"][i]["metrics"]
                    if key == "goodput":
                        values.append(pd["goodput"] / m["goodput"] if m["goodput"] else float("inf"))
                    elif pd[key]["p99"] and m[key]["p99"]:
                        values.append(m[key]["p99"] / pd[key]["p99"])
                cells.append(_spread(values))
            say(f"| {rate} | {design} | {' | '.join(cells)} |")
    # how undisturbed PD's decode stays: its TBT against the bare step (the same batch class,
    # pinned like the decode stage) at the batch sizes the load reaches
    context = sum(int(x) for x in opts.input_range.split(":")) // 2 + 48
    bare = {b: _bare_decode_step_s(b, context, 20) for b in (1, 4, 8)}
    say()
    say(f"PD's decode under this load against the bare decode step ({context}-token context, core 1, 1 thread): "
        + ", ".join(f"batch {b} {t * 1e3:.1f} ms" for b, t in bare.items()))
    say()
    say("| rate | PD TBT p50 (median of reps) | PD TBT p99 (median, range) | "
        + " | ".join(f"TBT p99 / bare step b{b}" for b in bare) + " |")
    say("|---|---:|---|" + "---:|" * len(bare))
    for i, rate in enumerate(rates.split(",")):
        p50 = statistics.median(r["pd"]["runs"][i]["metrics"]["tbt_ms"]["p50"] for r in repeats)
        p99 = [r["pd"]["runs"][i]["metrics"]["tbt_ms"]["p99"] for r in repeats]
        ratios = " | ".join(f"{statistics.median(p99) / (t * 1e3):.2f}x" for t in bare.values())
        say(f"| {rate} | {p50:.1f} ms | {_spread(p99, ' ms')} | {ratios} |")
    (out / "bare_steps.json").write_text(json.dumps(bare))


def _spread(values: list[float], unit: str = "x") -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}–{max(values):.2f})"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or theirs is None else f"{theirs / ours:.2f}x"


def part_trace(opts, out: Path) -> None:
    trace = ["--dataset", "trace", "--dataset-path", str(opts.trace), "--token-scale", "0.02",
             "--time-scale", str(opts.trace_time_scale), "--limit", str(opts.trace_limit),
             "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
    results = _designs(out, "trace", trace, plot=True)
    say()
    say(f"Scaled conversation trace (token scale 0.02, time scale {opts.trace_time_scale:g}: arrivals "
        f"{1 / opts.trace_time_scale:g}x as far apart; the first {opts.trace_limit} requests):")
    say()
    say("| design | TTFT p50 | TTFT p99 | TBT p99 | Mooncake TBT p99 | goodput (req/s) | good |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    for design in DESIGNS:
        m = results[design]["runs"][0]["metrics"]
        say(f"| {design} | {_f(m['ttft_ms']['p50'])} | {_f(m['ttft_ms']['p99'])} | {_f(m['tbt_ms']['p99'])} | "
            f"{_f(m['tbt_mooncake_ms']['p99'])} | {m['goodput']:.3f} | {m['goodput_fraction']:.0%} |")


# --- 2. KV tail ----------------------------------------------------------------------------------


def part_kv_tail(opts, out: Path) -> None:
    link = {"bandwidth": opts.link_bandwidth, "latency": opts.link_latency}
    rows = []
    for streaming in ("layer", "request"):
        with serving(kv_streaming=streaming, link_options=link, request_timeout_s=1200) as server:
            for tokens in opts.kv_tokens:
                say(f"- kv_streaming={streaming}: a {tokens}-token prompt through a {opts.link_bandwidth} link")
                timeline = one_prompt_timeline(server.url, tokens)
                summary = kv_summary(timeline)
                rows.append((streaming, tokens, summary))
                (out / f"timeline-{streaming}-{tokens}.json").write_text(json.dumps(timeline))
                plot(timeline, out / f"timeline-{streaming}-{tokens}.png",
                     title=f"kv_streaming={streaming}, {tokens} tokens, {opts.link_bandwidth}")
    say()
    say(f"KV tail (prefill's last layer computed -> decode holds all KV) through an emulated "
        f"{opts.link_bandwidth} / {opts.link_latency} link on prefill -> kv-shuttle:")
    say()
    say("| streaming | prompt tokens | prefill (s) | whole transfer (s) | one layer (ms) | KV tail (ms) "
        "| tail / one layer | hidden |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|")
    for streaming, tokens, s in rows:
        say(f"| {streaming} | {tokens} | {s['prefill_s']:.2f} | {s['whole_transfer_s']:.2f} | "
            f"{s['one_layer_transfer_s'] * 1e3:.1f} | {s['kv_tail_s'] * 1e3:.1f} | "
            f"{s['tail_over_one_layer']:.2f} | {s['hidden_fraction']:.0%} |")


# --- 3. pipeline overhead ------------------------------------------------------------------------


def _bare_decode_step_s(batch: int, prompt_tokens: int, steps: int) -> float:
    """The engine's own decode loop, pinned like the decode stage (core 1, one thread), with the
    batch the decode stage runs (KV in pool blocks where the attention kernel serves)."""
    import torch

    from pdflow.engine import DecodeBatch, Sampler, Sequence, load_model
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout
    from pdflow.messages import SamplingParams
    from pdflow.models import resolve

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    try:
        loaded = load_model(resolve("smollm2", progress=False))
        layout = loaded.layout
        kv = [torch.randn(layout.num_kv_heads, prompt_tokens, layout.head_dim) for _ in range(2)]
        if PagedDecodeBatch.runs(loaded):
            blocks = batch * -(-(prompt_tokens + steps + 8) // 64)
            decode = PagedDecodeBatch(loaded, batch, KvPool(ArenaLayout(layout, 64, blocks)))
            add = decode.add_from
        else:
            decode = DecodeBatch(loaded, batch)
            add = decode.add
        for i in range(batch):
            sampler = Sampler(SamplingParams(temperature=0, max_tokens=steps + 4))
            add(Sequence(str(i), prompt_tokens, 100 + i, sampler), lambda layer: (kv[0], kv[1]))
        decode.step()  # warm-up
        started = time.perf_counter()
        for _ in range(steps):
            decode.step()
        return (time.perf_counter() - started) / steps
    finally:  # the servers started later (and their unpinned stages) must not inherit core 1 only
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _stream_arrivals(url: str, prompt: list[int], max_tokens: int) -> tuple[str, list[float]]:
    arrivals, request_id = [], ""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                request_id = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.monotonic())
    return request_id, arrivals


def _pipeline_decode_step_s(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Median time between decode steps while every one of ``prompts`` streams at once."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: _stream_arrivals(url, p, new_tokens), prompts))
    timelines = [httpx.get(f"{url}/debug/timeline/{rid}", timeout=30).json() for rid, _ in streams]
    # steady state: steps while every request of the batch was running
    start = max(t["decode.steps"][0] for t in timelines)
    end = min(t["decode.steps"][-1] for t in timelines)
    steps = sorted({round(s, 6) for t in timelines for s in t["decode.steps"] if start <= s <= end})
    return statistics.median(b - a for a, b in zip(steps, steps[1:]))


def part_overhead(opts, out: Path) -> None:
    batch, prompt_tokens, new_tokens = opts.batch, 128, 256  # long enough that all of them decode together
    prompts = [[(i * 31 + j * 7) % 40000 + 1000 for j in range(prompt_tokens)] for i in range(batch)]
    rounds, deltas = [], []
    with serving() as server:
        # Interleaved: the bare loop (while the pipeline idles) and the pipeline take turns, so
        # that both see the same machine; this box's speed drifts by 30% within minutes.
        for _ in range(opts.overhead_rounds):
            bare = _bare_decode_step_s(batch, prompt_tokens + new_tokens // 2, 32)
            rounds.append((bare, _pipeline_decode_step_s(server.url, prompts, new_tokens)))
            # one request alone: token i >= 1 comes from decode step i - 1 (token 0 from prefill)
            rid, arrivals = _stream_arrivals(server.url, prompts[0], new_tokens)
            single = httpx.get(f"{server.url}/debug/timeline/{rid}", timeout=30).json()
            deltas += [a - s for a, s in zip(arrivals[1:], single["decode.steps"])]
    ratios = [bare / pipeline for bare, pipeline in rounds]
    say()
    say(f"Pipeline overhead (batch {batch}, {prompt_tokens}-token prompts, {new_tokens} new tokens each; "
        f"{opts.overhead_rounds} interleaved rounds):")
    say()
    say("| round | bare engine decode step (core 1, 1 thread) | PD pipeline decode step, steady state (median) "
        "| pipeline / bare tokens per second |")
    say("|---:|---:|---:|---:|")
    for i, ((bare, pipeline), ratio) in enumerate(zip(rounds, ratios), 1):
        say(f"| {i} | {bare * 1e3:.1f} ms = {batch / bare:.1f} tok/s | {pipeline * 1e3:.1f} ms = "
            f"{batch / pipeline:.1f} tok/s | {ratio:.2f}x |")
    say()
    ordered = sorted(deltas)
    say(f"- pipeline / bare tokens per second, median of the rounds: {statistics.median(ratios):.2f}x")
    say(f"- decode produced a token -> the client received it ({len(deltas)} tokens, one request alone): "
        f"p50 {statistics.median(deltas) * 1e3:.2f} ms, p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1e3:.2f} ms")
    (out / "overhead.json").write_text(json.dumps({"rounds_step_s": rounds, "token_to_client_s": deltas}))


def _socket_arrivals(port: int, prompt: list[int], max_tokens: int) -> tuple[str, list[float]]:
    """As :func:`_stream_arrivals`, but each token's time is when its server-sent event's bytes
    reach the client's socket (a raw HTTP/1.1 request, no client library parsing in between)."""
    import socket

    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    arrivals, received, request_id = [], b"", ""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while b"[DONE]" not in received:
            data = sock.recv(1 << 16)
            now = time.monotonic()
            if not data:
                break
            arrivals += [now] * (data.count(b'"text":"') - data.count(b'"text":""'))  # events with text
            received += data
    if b'"id":"' in received:
        start = received.index(b'"id":"') + 6
        request_id = received[start : received.index(b'"', start)].decode()
    return request_id, arrivals


def part_hops(opts, out: Path) -> None:
    """A token's way from decode to the client: straight to ingress (the default, one control hop)
    against through an egress stage (two hops); one server up at a time, in turns; each token's
    arrival taken at the client's socket and after httpx has parsed its event."""
    prompt, new_tokens = [(j * 7) % 40000 + 1000 for j in range(128)], 48
    names = {False: "ingress (1 hop)", True: "egress stage (2 hops)"}
    deltas = {(name, how): [] for name in names.values() for how in ("socket", "httpx")}
    for _ in range(opts.hop_rounds):
        for egress, name in names.items():
            with serving(egress=egress) as server:
                for _ in range(opts.hop_requests):
                    for how, stream in (("socket", lambda: _socket_arrivals(server.base, prompt, new_tokens)),
                                        ("httpx", lambda: _stream_arrivals(server.url, prompt, new_tokens))):
                        rid, arrivals = stream()
                        steps = httpx.get(f"{server.url}/debug/timeline/{rid}", timeout=30).json()["decode.steps"]
                        deltas[(name, how)] += [a - s for a, s in zip(arrivals[1:], steps)]
    say()
    say(f"A token from decode to the client ({opts.hop_rounds} rounds of {opts.hop_requests} requests alone on "
        f"each pipeline, one server up at a time, {new_tokens} tokens each):")
    say()
    say("| tokens go | arrival taken | tokens | p50 | p90 | p99 |")
    say("|---|---|---:|---:|---:|---:|")
    for (name, how), values in deltas.items():
        ordered = sorted(values)

        def at(q):
            return ordered[int(q * (len(ordered) - 1))] * 1e3

        taken = "at the client's socket" if how == "socket" else "after httpx parsed the event"
        say(f"| {name} | {taken} | {len(values)} | {at(0.5):.2f} ms | {at(0.9):.2f} ms | {at(0.99):.2f} ms |")
    (out / "hops.json").write_text(json.dumps({f"{name}, {how}": v for (name, how), v in deltas.items()}))


def main() -> int:
    parser = experiment_parser(__doc__, "experiment")
    parser.add_argument("--parts", default="serve,trace,kv-tail,overhead,hops")
    parser.add_argument("--quick", action="store_true", help="fewer requests and smaller prompts (a smoke run)")
    parser.add_argument("--rates", default="0.4,0.8", help="request rates of part serve (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=60, help="requests per rate (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of part serve (default: %(default)s)")
    parser.add_argument("--input-range", default="32:512")
    # SLOs from the engine's step (about 50 ms at batch 8 on one core): TBT 6x that, TTFT a few prefills
    add_slo_arguments(parser, ttft_ms=5000.0, tbt_ms=300.0)
    add_trace_argument(parser)
    parser.add_argument("--trace-limit", type=int, default=40)
    parser.add_argument("--trace-time-scale", type=float, default=0.1)
    parser.add_argument("--kv-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8000])
    parser.add_argument("--link-bandwidth", default="50Mbit")
    parser.add_argument("--link-latency", default="0.5ms")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--hop-requests", type=int, default=5, help="requests per server and round in part hops")
    parser.add_argument("--hop-rounds", type=int, default=2, help="rounds of part hops (each starts both servers)")
    opts = parser.parse_args()
    if opts.quick:
        opts.rates, opts.num_prompts, opts.input_range, opts.trace_limit, opts.repeats = "0.5", 4, "16:128", 4, 2
        opts.kv_tokens, opts.batch, opts.overhead_rounds, opts.hop_requests, opts.hop_rounds = [256], 4, 1, 2, 1
    if "trace" in opts.parts.split(","):
        require_trace(opts.trace)  # before an hour of part serve, not after
    parts = {"serve": part_serve, "trace": part_trace, "kv-tail": part_kv_tail, "overhead": part_overhead,
             "hops": part_hops}
    return REPORT.run("pdflow disaggregation experiment", parts, opts)


if __name__ == "__main__":
    sys.exit(main())
