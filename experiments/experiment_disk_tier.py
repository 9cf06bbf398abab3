#!/usr/bin/env python
"""The KV store's disk tier, measured on this machine (issue 12's benchmarks).

1. io: `pdflow bench disk` (the tier's reads and writes beside dd, plain file I/O and memcpy),
   for 64- and 16-token blocks.
2. capacity: a scaled replay of conversations from Mooncake's conversation trace (one request at
   a time, in the trace's order) against stores whose memory tier holds 100%, 25% and 10% of the
   replay's working set, memory only and memory + disk: hit ratio (cached / prompt tokens) and
   TTFT p50 / p99.
3. prefetch: disk hits arriving in bursts behind a queue, prefetch on against off: their TTFT,
   and how much of the disk read the queue hid (from the request timelines: how long prefill
   waited for the plan once it got to a request, against the store's disk read time).

    .venv/bin/python experiments/experiment_disk_tier.py --out bench-results/disk-tier
    .venv/bin/python experiments/experiment_disk_tier.py --parts prefetch --quick

The disk tier lives under --disk-dir (default: a directory under /work, this machine's disk).
Everything it prints goes to <out>/summary.md too; raw results to <out>/*.json.

The trace (``--trace``, default ``../shared/traces/conversation_trace.jsonl`` beside the checkout) is
Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache
License 2.0); ``--help`` gives the command that fetches it.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pdflow.bench.experiments import (ROOT, Report, add_trace_argument, bench, experiment_parser, figure, require_trace,
                                      serving)

REPORT = Report()
say = REPORT.say


def _disk(opts, name: str) -> Path:
    path = opts.disk_dir / name
    shutil.rmtree(path, ignore_errors=True)
    return path


def _drop_page_cache() -> None:
    """Drop clean pages from the page cache (root only; else reads may come from memory)."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        say("(cannot drop the page cache here: disk reads may come from memory)")


def _stats(server) -> dict:
    time.sleep(1.2)  # one heartbeat after the last change
    return server.health()["stages"]["kv-shuttle-0"].get("stats", {})


# --- 1. io -----------------------------------------------------------------------------------------


def part_io(opts, out: Path) -> None:
    for block_tokens in (64, 16):
        argv = ["--dir", str(opts.disk_dir), "--total", opts.io_total, "--block-tokens", str(block_tokens),
                "--json", str(out / f"io-{block_tokens}.json")]
        say(f"`pdflow bench disk {' '.join(argv)}`:")
        say()
        done = subprocess.run([str(ROOT / ".venv" / "bin" / "pdflow"), "bench", "disk", *argv],
                              capture_output=True, text=True, check=True)
        for line in done.stdout.splitlines():
            if line.startswith(("|", "read back")) or "blocks of" in line:
                say(line)
        say()


# --- 2. capacity -----------------------------------------------------------------------------------


def _conversations(opts, out: Path) -> Path:
    """A Mooncake-format subset of the conversation trace: every request of ``opts.conversations``
    conversations (seeded) of 3 to 6 turns whose prompts stay under ``opts.max_input`` tokens
    (before scaling), so that the memory tier at 10% of the working set still holds a request."""
    import collections

    rows = [json.loads(line) for line in opts.trace.read_text().splitlines() if line.strip()]
    conversations = collections.defaultdict(list)
    for row in rows:
        conversations[tuple(row["hash_ids"][:2])].append(row)
    fit = sorted(key for key, turns in conversations.items()
                 if 3 <= len(turns) <= 6 and max(r["input_length"] for r in turns) <= opts.max_input)
    picked = set(random.Random(5).sample(fit, opts.conversations))
    subset = out / "conversations.jsonl"
    subset.write_text("".join(json.dumps(row) + "\n" for row in rows if tuple(row["hash_ids"][:2]) in picked))
    return subset


def part_capacity(opts, out: Path) -> None:
    from pdflow.bench.workloads import WorkloadSpec, block_size, trace_rows
    from pdflow.kv.layout import KvLayout

    subset = _conversations(opts, out)
    block = block_size(opts.token_scale)
    rows = trace_rows(WorkloadSpec("trace", path=str(subset), token_scale=opts.token_scale))
    prefixes = {tuple(row["hash_ids"][: k + 1]) for row in rows for k in range(len(row["hash_ids"]))}
    block_bytes = KvLayout(30, 3, 64).request_bytes(block)
    working_set = len(prefixes) * block_bytes
    largest = max(len(row["hash_ids"]) for row in rows)
    argv = ["--dataset", "trace", "--dataset-path", str(subset), "--token-scale", str(opts.token_scale),
            "--request-rate", "inf", "--max-concurrency", "1", "--output-len", "8"]
    say(f"Mooncake conversation trace, {opts.conversations} conversations of 3-6 turns with prompts under "
        f"{opts.max_input} tokens picked at random ({len(rows)} requests, in the trace's order, one at a time), "
        f"token scale {opts.token_scale} (blocks of {block} tokens, {block_bytes / 2**20:.2f} MiB each); working set "
        f"{len(prefixes)} prompt blocks = {working_set / 2**20:.0f} MiB, the largest prompt {largest} blocks "
        f"(`pdflow bench serve {' '.join(argv)}`), disk tier in {opts.disk_dir}:")
    say()
    say("| memory tier | of working set | tiers | hit / prompt tokens | of memory-only at 100% | TTFT p50 (ms) | "
        "TTFT p99 (ms) | blocks read from disk | disk read (ms) | evictions |")
    say("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    results, baseline = [], None
    for share in opts.shares:
        for tiers in ("memory", "memory + disk"):
            if share == 1.0 and tiers == "memory + disk":
                continue  # nothing to spill
            store = int(working_set * share / 0.85) + 2 * block_bytes  # (eviction stops at the low watermark)
            kv = {"block_tokens": block, "store_bytes": store}
            if tiers != "memory":
                kv |= {"disk_path": str(_disk(opts, "capacity")), "disk_capacity": "8GiB", "disk_segment_bytes": "64MiB"}
            name = f"capacity-{int(share * 100)}-{'disk' if tiers != 'memory' else 'memory'}"
            with serving(kv=kv, request_timeout_s=900) as server:
                result = bench(server.url, out / f"{name}.json", argv)
                stats = _stats(server)
            m = result["runs"][0]["metrics"]
            hit = m["cache"]["hit_ratio"]
            if share == 1.0 and tiers == "memory":
                baseline = hit
            results.append({"share": share, "tiers": tiers, "store_bytes": store, "metrics": m, "stats": stats})
            of = f"{hit / baseline:.1%}" if baseline else "-"
            read_ms = stats["disk_load_us"] / 1000 if "disk_load_us" in stats else None
            say(f"| {store / 2**20:.0f} MiB | {share:.0%} | {tiers} | {hit:.1%} | {of} | {figure(m['ttft_ms']['p50'])} | "
                f"{figure(m['ttft_ms']['p99'])} | {stats.get('disk_loaded_blocks', '-')} | {figure(read_ms)} | "
                f"{stats.get('evictions', '-')} |")
            if m["failed"]:
                say(f"  ({m['failed']} requests failed: {m['errors'][:2]})")
    (out / "capacity.json").write_text(json.dumps(results, indent=1))


# --- 3. prefetch -----------------------------------------------------------------------------------


def _complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict:
    began = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0}, timeout=600)
    reply.raise_for_status()
    body = reply.json()
    return {"id": body["id"], "ttft_s": time.perf_counter() - began,
            "cached": body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def part_prefetch(opts, out: Path) -> None:
    rng = random.Random(11)
    docs = [[rng.randrange(1000, 40000) for _ in range(opts.doc_len)] for _ in range(opts.burst)]
    block_bytes = 30 * 2 * 64 * 3 * 64 * 4
    memory = (opts.doc_len // 64 + 2) * block_bytes * (opts.burst + 2)  # a burst fits; the fillers evict it
    # (a document's first ask computes it: 1,024 tokens take seconds here, so the set-up is most of the run)
    say(f"{opts.burst} documents of {opts.doc_len} tokens, each asked once to put it on disk; memory tier "
        f"{memory / 2**20:.0f} MiB; then, {opts.rounds} times: other documents push them out of memory, a cold "
        f"prompt of {opts.cold_len} tokens starts prefill, and one new question about every document arrives at "
        "once (the burst queues behind the cold prompt and each other). Disk tier in "
        f"{opts.disk_dir}; TTFT of the burst's requests (all disk hits):")
    say()
    say("| prefetch | requests | cached tokens / request | TTFT p50 (ms) | TTFT p90 (ms) | TTFT max (ms) | "
        "disk read (ms, all) | prefill waited for plans (ms, all) | read hidden |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for prefetch in (True, False):
        kv = {"store_bytes": memory, "disk_path": str(_disk(opts, "prefetch")), "disk_capacity": "8GiB",
              "disk_segment_bytes": "64MiB", "prefetch": prefetch}
        with serving(kv=kv, request_timeout_s=900) as server:
            for doc in docs:
                _complete(server.url, doc + [7, 7])
            samples, waited = [], 0.0
            before = _stats(server)
            for r in range(opts.rounds):
                for i in range(opts.burst + 2):  # fillers: memory's blocks go to other documents
                    _complete(server.url, [rng.randrange(1000, 40000) for _ in range(opts.doc_len)])
                _stats(server)  # (spills done)
                _drop_page_cache()  # the documents' blocks are on the disk, not in the page cache
                cold = [rng.randrange(1000, 40000) for _ in range(opts.cold_len)]
                with ThreadPoolExecutor(opts.burst + 1) as pool:
                    ahead = pool.submit(_complete, server.url, cold)
                    time.sleep(0.05)
                    burst = [pool.submit(_complete, server.url, doc + [100 + r, 100 + i]) for i, doc in enumerate(docs)]
                    results = [f.result() for f in burst]
                    ahead.result()
                for result in results:
                    timeline = httpx.get(f"{server.url}/debug/timeline/{result['id']}", timeout=10).json()
                    waited += timeline["prefill.plan_in"][0] - timeline["prefill.dequeued"][0]
                samples += results
            after = _stats(server)
        read_ms = (after["disk_load_us"] - before["disk_load_us"]) / 1000
        ttft = sorted(1000 * s["ttft_s"] for s in samples)
        hidden = max(0.0, 1 - 1000 * waited / read_ms) if read_ms else None
        rows["on" if prefetch else "off"] = {"ttft_ms": ttft, "cached": [s["cached"] for s in samples],
                                             "disk_read_ms": read_ms, "waited_ms": 1000 * waited}
        say(f"| {'on' if prefetch else 'off'} | {len(samples)} | {statistics.mean(s['cached'] for s in samples):.0f} | "
            f"{statistics.median(ttft):.0f} | {ttft[int(0.9 * (len(ttft) - 1))]:.0f} | {ttft[-1]:.0f} | {read_ms:.0f} | "
            f"{1000 * waited:.0f} | {figure(hidden and 100 * hidden, '.0f')}% |")
    on, off = statistics.median(rows["on"]["ttft_ms"]), statistics.median(rows["off"]["ttft_ms"])
    say()
    say(f"- TTFT p50 of disk hits, prefetch off / on: **{off / on:.2f}x**")
    (out / "prefetch.json").write_text(json.dumps(rows, indent=1))


def main() -> int:
    parser = experiment_parser(__doc__, "disk-tier")
    parser.add_argument("--parts", default="io,capacity,prefetch")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    parser.add_argument("--disk-dir", type=Path, default=Path("/work/pdflow-disk-tier-bench"))
    parser.add_argument("--io-total", default="2GiB")
    add_trace_argument(parser)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=24000, help="capacity: the largest prompt, before scaling")
    parser.add_argument("--token-scale", type=float, default=0.03125)
    parser.add_argument("--shares", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.25, 0.1])
    parser.add_argument("--burst", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--cold-len", type=int, default=256)
    opts = parser.parse_args()
    if opts.quick:
        opts.io_total, opts.conversations, opts.shares, opts.burst, opts.rounds = "256MiB", 10, [1.0, 0.1], 3, 1
    if "capacity" in opts.parts.split(","):
        require_trace(opts.trace)
    opts.disk_dir.mkdir(parents=True, exist_ok=True)
    try:
        return REPORT.run("pdflow disk tier experiment", {"io": part_io, "capacity": part_capacity,
                                                          "prefetch": part_prefetch}, opts)
    finally:
        shutil.rmtree(opts.disk_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
