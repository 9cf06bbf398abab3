#!/usr/bin/env python
"""Does prefix reuse pay? Reuse on against reuse off, side by side, on this machine.

1. lookup: hashing an 8K-token prompt's block ids and looking them up, per block size; a block's
   commit and its verification on a hit.
2. rag: K documents of L tokens, each asked M questions, one request at a time: TTFT with the KV
   store against prefix_cache = false (and against llama.cpp's own prompt cache, given
   --llama-cpp-url), the hit ratio beside an unbounded cache's.
3. multiturn: chat sessions of N turns re-sending their history with the model's own answers;
   blocks: the same against stores of each block size (--block-sizes).
4. trace: a scaled replay of Mooncake's conversation trace: prompt tokens computed against the
   trace's own reusable fraction, goodput under SLOs.
5. capacity: the multi-turn workload with smaller and smaller stores: hit ratio against the bound;
   with --store-codecs, each size once per codec the store keeps its blocks in ([kv] codec).
6. overhead: unique prompts (nothing to reuse) to two servers, reuse on and off, alternating
   request by request: what the store's bookkeeping adds to TTFT.

    .venv/bin/python experiments/experiment_prefix_reuse.py --out bench-results/prefix-reuse
    .venv/bin/python experiments/experiment_prefix_reuse.py --parts lookup,rag --quick

llama.cpp (a separate install; it compiles for ~10 minutes):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install 'llama-cpp-python[server]'
    python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --n_threads 2 --cache True --port 8080
    ... --llama-cpp-url http://127.0.0.1:8080

Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json.

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from pdflow.bench.experiments import (Report, add_slo_arguments, add_trace_argument, bench, experiment_parser, figure,
                                      require_trace, serving)

REPORT = Report()
say = REPORT.say


# --- 1. lookup -------------------------------------------------------------------------------------


def part_lookup(opts, out: Path) -> None:
    from pdflow.kv.blocks import BlockHasher
    from pdflow.kv.layout import KvLayout
    from pdflow.kv.store import KvStore

    kv = KvLayout(30, 3, 64)
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(8192)]
    say("8K-token prompt, SmolLM2 KV in float32 (46 KB per token); medians of 20 runs:")
    say()
    say("| block tokens | hash block ids | lookup (all hit) | hash + lookup | commit a block | verify a block |")
    say("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for bt in opts.block_sizes:
        hasher = BlockHasher("smollm2", "float32", bt)
        store = KvStore(kv, bt, (8192 // bt + 2) * 2 * 30 * bt * 768)
        store.memory.fill_(1)  # touch the arena: what a filled store looks like
        ids = hasher.ids(tokens)
        lease = store.lease("fill", ids)
        started = time.perf_counter()
        for i in range(len(ids)):
            store.commit(lease, i)
        commit = (time.perf_counter() - started) / len(ids)
        store.release("fill")
        hashing = statistics.median(_timed(lambda: hasher.ids(tokens)) for _ in range(20))
        lookup = statistics.median(_timed(lambda: store.lookup(ids)) for _ in range(20))

        def verified():
            store.lease("read", ids, write=False, count=False)
            store.release("read")

        verify = _timed(verified) / len(ids)
        rows.append({"block_tokens": bt, "hash_s": hashing, "lookup_s": lookup, "commit_s": commit, "verify_s": verify})
        say(f"| {bt} | {hashing * 1e3:.3f} ms | {lookup * 1e3:.3f} ms | {(hashing + lookup) * 1e3:.3f} ms | "
            f"{commit * 1e3:.2f} ms | {verify * 1e3:.2f} ms |")
    (out / "lookup.json").write_text(json.dumps(rows))


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# --- servers and runs ------------------------------------------------------------------------------


def _servers(opts) -> dict[str, dict]:
    designs = {"pd reuse": {}, "pd no reuse": {"kv": {"prefix_cache": False}}}
    if opts.shm or opts.shm_copies:  # one host: KV computed and attended in the store's blocks
        designs["pd reuse shm zero-copy"] = {"transport": "shm"}
    if opts.shm_copies:  # and the same with copies
        designs["pd reuse shm copies"] = {"transport": "shm", "kv": {"zero_copy": False}}
    if opts.colocated:
        designs |= {"colocated reuse": {"mode": "colocated"},
                    "colocated no reuse": {"mode": "colocated", "kv": {"prefix_cache": False}}}
    return designs


def _run_designs(opts, out: Path, name: str, argv: list[str], kv: dict | None = None,
                 request_timeout_s: float = 600) -> dict[str, dict]:
    results = {}
    for design, config in _servers(opts).items():
        config = {**config, "kv": {**(kv or {}), **config.get("kv", {})}, "request_timeout_s": request_timeout_s}
        with serving(**config) as server:
            say(f"- {design}: {name}")
            results[design] = bench(server.url, out / f"{name}-{design.replace(' ', '-')}.json", argv)
    if opts.llama_cpp_url:
        say(f"- llama.cpp ({opts.llama_cpp_url}): {name}")
        results["llama.cpp"] = bench(opts.llama_cpp_url, out / f"{name}-llama-cpp.json",
                                     argv + ["--text-prompts", "--model", "smollm2"])
    return results


def _table(results: dict[str, dict], baseline: str = "pd no reuse", reused: str = "pd reuse") -> None:
    say("| server | TTFT p50 (ms) | TTFT p90 (ms) | E2E p50 (ms) | cached / prompt tokens | unbounded cache | "
        "of bound | prompt tokens computed | goodput (req/s) |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for design, result in results.items():
        m = result["runs"][0]["metrics"]
        c = m["cache"]
        hit = f"{c['hit_ratio']:.1%}" if c["reported"] else "-"
        bound = f"{c['bound_ratio']:.1%}" if c["bound_ratio"] is not None else "-"
        of = f"{c['of_bound']:.1%}" if c["reported"] and c["of_bound"] is not None else "-"
        computed = c["computed_tokens"] if c["reported"] else "-"
        say(f"| {design} | {figure(m['ttft_ms']['p50'])} | {figure(m['ttft_ms']['p90'])} | "
            f"{figure(m['e2e_ms']['p50'])} | {hit} | {bound} | {of} | {computed} | {m['goodput']:.3f} |")
    say()
    ttft = {d: r["runs"][0]["metrics"]["ttft_ms"]["p50"] for d, r in results.items()}
    for off, on in ((baseline, reused), ("colocated no reuse", "colocated reuse")):
        if off in ttft and on in ttft and ttft[on]:
            say(f"- TTFT p50 {off} / {on}: **{ttft[off] / ttft[on]:.1f}x**")
    if "llama.cpp" in ttft and ttft["llama.cpp"] and ttft.get(reused):
        say(f"- TTFT p50 {reused} / llama.cpp (its prompt cache): **{ttft[reused] / ttft['llama.cpp']:.2f}x**")


# --- 2, 3. rag and multi-turn ----------------------------------------------------------------------


def part_rag(opts, out: Path) -> None:
    argv = ["--dataset", "rag", "--documents", str(opts.documents), "--doc-len", str(opts.doc_len),
            "--questions", str(opts.questions), "--question-len", "32", "--output-len", "16",
            "--max-concurrency", "1", "--seed", "1"]
    results = _run_designs(opts, out, "rag", argv)
    say()
    say(f"RAG: {opts.documents} documents of {opts.doc_len} tokens, {opts.questions} questions of 32 tokens each, "
        "16 output tokens, one request at a time (`pdflow bench serve " + " ".join(argv) + "`):")
    say()
    _table(results)


def part_multiturn(opts, out: Path) -> None:
    argv = ["--dataset", "multiturn", "--sessions", str(opts.sessions), "--turns", str(opts.turns), "--input-len",
            str(opts.first_len), "--turn-len", "64", "--output-len", "32", "--think-time", "1",
            "--max-concurrency", "1", "--seed", "2"]
    results = _run_designs(opts, out, "multiturn", argv)
    say()
    say(f"Multi-turn: {opts.sessions} sessions of {opts.turns} turns, a {opts.first_len}-token first message, then "
        "64-token messages, 32-token answers sent back, 1 s think time, one request at a time "
        "(`pdflow bench serve " + " ".join(argv) + "`):")
    say()
    _table(results)


def part_blocks(opts, out: Path) -> None:
    """The multi-turn workload against stores of different block sizes: granularity against cost."""
    argv = ["--dataset", "multiturn", "--sessions", str(opts.sessions), "--turns", str(opts.turns), "--input-len",
            str(opts.first_len), "--turn-len", "64", "--output-len", "32", "--think-time", "1",
            "--max-concurrency", "1", "--seed", "2"]
    results = {}
    for bt in opts.block_sizes:
        with serving(kv={"block_tokens": bt}, request_timeout_s=600) as server:
            say(f"- pd reuse, {bt}-token blocks: multiturn")
            results[bt] = bench(server.url, out / f"blocks-{bt}.json", argv)
    with serving(kv={"prefix_cache": False}) as server:
        say("- pd no reuse: multiturn")
        off = bench(server.url, out / "blocks-off.json", argv)["runs"][0]["metrics"]["ttft_ms"]["p50"]
    say()
    say("The multi-turn workload above (`pdflow bench serve " + " ".join(argv) + "`) against stores of each block "
        f"size, and once without reuse (TTFT p50 {off:.0f} ms):")
    say()
    say("| block tokens | TTFT p50 (ms) | TTFT p90 (ms) | no reuse / reuse, TTFT p50 | cached / prompt tokens | "
        "prompt tokens computed |")
    say("|---:|---:|---:|---:|---:|---:|")
    for bt, result in results.items():
        m = result["runs"][0]["metrics"]
        c = m["cache"]
        say(f"| {bt} | {figure(m['ttft_ms']['p50'])} | {figure(m['ttft_ms']['p90'])} | "
            f"{off / m['ttft_ms']['p50']:.1f}x | {c['hit_ratio']:.1%} | {c['computed_tokens']} |")


# --- 4. trace --------------------------------------------------------------------------------------


def part_trace(opts, out: Path) -> None:
    from pdflow.bench.workloads import WorkloadSpec, block_size, reusable_fraction, trace_rows

    argv = ["--dataset", "trace", "--dataset-path", str(opts.trace), "--token-scale", str(opts.trace_token_scale),
            "--time-scale", str(opts.trace_time_scale), "--sample-conversations", str(opts.trace_conversations),
            "--seed", "5", "--slo-ttft", str(opts.slo_ttft), "--slo-tbt", str(opts.slo_tbt)]
    block = block_size(opts.trace_token_scale)
    spec = WorkloadSpec("trace", path=str(opts.trace), token_scale=opts.trace_token_scale,
                        sample_conversations=opts.trace_conversations, seed=5)
    rows = trace_rows(spec)
    results = _run_designs(opts, out, "trace", argv, kv={"block_tokens": block}, request_timeout_s=900)
    reusable = reusable_fraction(rows)
    say()
    say(f"Mooncake conversation trace: every request of {opts.trace_conversations} conversations picked at random "
        f"({len(rows)} requests over {(rows[-1]['timestamp'] - rows[0]['timestamp']) / 1000:.0f} s), token scale "
        f"{opts.trace_token_scale} (512-token hash blocks become {block} tokens; the store's blocks too), time scale "
        f"{opts.trace_time_scale}; SLOs TTFT <= {opts.slo_ttft:.0f} ms, TBT <= {opts.slo_tbt:.0f} ms "
        "(`pdflow bench serve " + " ".join(argv) + "`):")
    say()
    _table(results)
    on, off = results["pd reuse"]["runs"][0]["metrics"], results["pd no reuse"]["runs"][0]["metrics"]
    drop = 1 - on["cache"]["computed_tokens"] / off["cache"]["computed_tokens"]
    say(f"- the trace's reusable fraction (blocks whose prefix an earlier request sent): {reusable:.1%}")
    say(f"- prompt tokens computed, reuse on against off: {drop:.1%} fewer (target: >= {reusable - 0.05:.1%})")
    if off["goodput"]:
        say(f"- goodput reuse on / off: **{on['goodput'] / off['goodput']:.2f}x** (target >= 1.3x)")


# --- 5. capacity -----------------------------------------------------------------------------------


def part_capacity(opts, out: Path) -> None:
    argv = ["--dataset", "multiturn", "--sessions", str(opts.capacity_sessions), "--turns", str(opts.turns),
            "--input-len", "512", "--turn-len", "64", "--output-len", "32", "--think-time", "0",
            "--request-rate", "inf", "--max-concurrency", "4", "--seed", "3"]
    say(f"Multi-turn, {opts.capacity_sessions} sessions of {opts.turns} turns (512-token first messages), four "
        "at a time, with stores of these sizes (`pdflow bench serve " + " ".join(argv) + "`):")
    say()
    say("| store | codec | blocks | requests done / failed | hit / prompt tokens | unbounded cache | of bound | evictions |")
    say("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for size in opts.capacities:
        for codec in opts.store_codecs:
            with serving(kv={"store_bytes": size, "codec": codec}, request_timeout_s=600) as server:
                result = bench(server.url, out / f"capacity-{size}-{codec}.json", argv)
                stats = server.health()["stages"]["kv-shuttle-0"].get("stats", {})
            m = result["runs"][0]["metrics"]
            c = m["cache"]
            rows.append({"store_bytes": size, "codec": codec, "cache": c, "stats": stats})
            say(f"| {size} | {codec} | {stats.get('blocks_total', '-')} | {m['completed']} / {m['failed']} "
                f"| {c['hit_ratio']:.1%} | {c['bound_ratio']:.1%} "
                f"| {figure(c['of_bound'] and 100 * c['of_bound'], '.1f')}% | {stats.get('evictions', '-')} |")
    (out / "capacity.json").write_text(json.dumps(rows))


# --- 6. overhead -----------------------------------------------------------------------------------


def _ttft(url: str, prompt: list[int]) -> float:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - started
    raise RuntimeError("no token came")


def part_overhead(opts, out: Path) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(1000, 40000) for _ in range(opts.overhead_tokens)] for _ in range(opts.overhead_requests)]
    with serving() as on, serving(kv={"prefix_cache": False}) as off:
        warm_up = [rng.randrange(1000, 40000) for _ in range(64)]
        _ttft(on.url, warm_up), _ttft(off.url, warm_up)
        pairs = []
        for i, prompt in enumerate(prompts):  # alternate which goes first: drift hits both alike
            first, second = (on, off) if i % 2 == 0 else (off, on)
            t_first, t_second = _ttft(first.url, prompt), _ttft(second.url, prompt)
            pairs.append((t_first, t_second) if first is on else (t_second, t_first))
        stats = on.health()["stages"]["kv-shuttle-0"].get("stats", {})
    ons, offs = [p[0] for p in pairs], [p[1] for p in pairs]
    ratio = statistics.median(x / y for x, y in pairs)
    say(f"Unique {opts.overhead_tokens}-token prompts (nothing to reuse), {len(pairs)} pairs, the two servers "
        "alternating request by request:")
    say()
    say("| | TTFT p50 (ms) | TTFT mean (ms) |")
    say("|---|---:|---:|")
    say(f"| pd reuse (store lookup, leases, commits) | {statistics.median(ons) * 1e3:.1f} | {statistics.fmean(ons) * 1e3:.1f} |")
    say(f"| pd no reuse | {statistics.median(offs) * 1e3:.1f} | {statistics.fmean(offs) * 1e3:.1f} |")
    say()
    say(f"- median of per-pair ratios on / off: **{ratio:.3f}** (target < 1.02); hits in the store: "
        f"{stats.get('hit_blocks', '-')}")
    (out / "overhead.json").write_text(json.dumps({"pairs_s": pairs, "stats": stats}))


def main() -> int:
    parser = experiment_parser(__doc__, "prefix-reuse")
    parser.add_argument("--parts", default="lookup,rag,multiturn,trace,capacity,overhead")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    parser.add_argument("--colocated", action="store_true", help="also the colocated worker, reuse on and off")
    parser.add_argument("--shm", action="store_true",
                        help="also disaggregated over shm links with zero copies (the default there)")
    parser.add_argument("--shm-copies", action="store_true",
                        help="also over shm with zero copies and with copies (kv.zero_copy = false)")
    parser.add_argument("--llama-cpp-url", help="a llama-cpp-python server with --cache True on the same GGUF")
    parser.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128, 256])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--doc-len", type=int, default=3000)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=1000)
    add_trace_argument(parser)
    parser.add_argument("--trace-conversations", type=int, default=40)
    parser.add_argument("--trace-token-scale", type=float, default=0.03125)
    parser.add_argument("--trace-time-scale", type=float, default=20.0)
    add_slo_arguments(parser, ttft_ms=10000.0, tbt_ms=500.0)
    parser.add_argument("--capacity-sessions", type=int, default=8)
    parser.add_argument("--capacities", type=lambda s: s.split(","), default=["192MiB", "288MiB", "384MiB", "4GiB"])
    parser.add_argument("--store-codecs", type=lambda s: s.split(","), default=["none"],
                        help="part capacity: the codecs the store keeps blocks in, e.g. none,int8 (default: none)")
    parser.add_argument("--overhead-requests", type=int, default=16)
    parser.add_argument("--overhead-tokens", type=int, default=256)
    opts = parser.parse_args()
    if opts.quick:
        opts.doc_len, opts.questions, opts.first_len, opts.turns, opts.trace_conversations = 300, 2, 200, 3, 4
        opts.capacity_sessions, opts.capacities, opts.overhead_requests = 2, ["96MiB", "4GiB"], 4
    if "trace" in opts.parts.split(","):
        require_trace(opts.trace)
    parts = {"lookup": part_lookup, "rag": part_rag, "multiturn": part_multiturn, "blocks": part_blocks,
             "trace": part_trace, "capacity": part_capacity, "overhead": part_overhead}
    return REPORT.run("pdflow prefix reuse experiment", parts, opts)


if __name__ == "__main__":
    sys.exit(main())
