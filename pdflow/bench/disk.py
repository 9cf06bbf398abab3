"""``pdflow bench disk``: the KV store's disk tier beside ``dd``, plain file I/O and memcpy.

From one run on one directory (put it on the disk you will give ``kv.disk_path``): blocks of the
model's KV layout (SmolLM2 by default: 30 layers, 3 KV heads of 64, fp32) are written from a
store arena into the disk tier (each a ``pwritev`` of its 60 per-layer spans, checksummed, synced
when a segment closes and at the end) and read back into the arena in runs of 1, 4 and 16 blocks
(each read verified against its checksum), beside:

- ``dd`` writing (``conv=fsync``) and reading the same number of bytes in the same sizes;
- plain sequential ``os.write`` / ``os.preadv`` of the same sizes, from and into memory as large
  as the data (a reader that keeps what it reads cannot reuse one small buffer as dd does, and
  writing into memory that is not in the CPU's cache is part of the cost);
- memcpy (a tensor copy) of the same bytes.

Reads are measured cold (the files' pages dropped from the page cache first: ``drop_caches`` as
root, else ``posix_fadvise(DONTNEED)``) and warm (from the page cache). Ratios are pdflow / dd
and pdflow / plain. Every pdflow read is checked against its checksum (xxh3), which the
baselines are not: that check is part of what is measured.
"""

from __future__ import annotations
# (the reads go through DiskTier.get_many: a run of blocks written together is one preadv)

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DESCRIPTION = __doc__


def _drop_cache(files: list[Path]) -> str:
    """Drop the files' pages from the page cache; how."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def _dd(args: list[str]) -> float:
    """Seconds dd reports for a copy."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    found = re.search(r"copied, ([0-9.e+-]+) s", done.stderr)
    if found is None:
        raise RuntimeError(f"cannot read dd's report: {done.stderr.strip()}")
    return float(found.group(1))


def run(args: argparse.Namespace, progress=sys.stderr) -> dict:
    import torch

    from pdflow.kv.disk import DiskTier
    from pdflow.kv.layout import KvLayout
    from pdflow.kv.outcomes import Outcome
    from pdflow.kv.store import KvStore

    kv = KvLayout(args.layers, args.kv_heads, args.head_dim, "float32")
    store = KvStore(kv, args.block_tokens, args.total_bytes, high_watermark=1.0, low_watermark=1.0)
    block, n = store.layout.block_bytes, store.layout.num_slots
    store.memory.copy_(torch.randint(0, 256, (store.memory.numel(),), dtype=torch.uint8))
    root = Path(tempfile.mkdtemp(prefix="pdflow-bench-disk-", dir=args.dir))
    results: dict = {"block_bytes": block, "blocks": n, "bytes": n * block, "dir": str(args.dir), "rows": []}
    try:
        # --- writes
        disk = DiskTier(root / "tier", 4 * n * block, block, segment_bytes=args.segment_bytes)
        began = time.perf_counter()
        for slot in range(n):
            disk.put(slot + 1, slot or None, store.slot_spans(slot))
        disk.close()  # syncs the last segment
        write_s = time.perf_counter() - began
        flat = root / "flat.bin"
        source = store.memory.numpy()
        began = time.perf_counter()
        fd = os.open(flat, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for slot in range(n):
            os.write(fd, source[slot * block : (slot + 1) * block])
        os.fsync(fd)
        os.close(fd)
        plain_write_s = time.perf_counter() - began
        dd_file = root / "dd.bin"
        dd_write_s = _dd([f"if={flat}", f"of={dd_file}", f"bs={block}", f"count={n}", "conv=fsync"])
        copy_to = torch.zeros_like(store.memory)  # (pages touched first: memcpy, not page faults)
        copy_to.copy_(store.memory)
        began = time.perf_counter()
        copy_to.copy_(store.memory)
        memcpy_s = time.perf_counter() - began
        del copy_to
        results["rows"].append(_row("write", 1, n * block, write_s, dd_write_s, plain_write_s, memcpy_s))
        print(f"write: pdflow {n * block / write_s / 1e9:.2f} GB/s, dd {n * block / dd_write_s / 1e9:.2f} GB/s",
              file=progress)
        # --- reads, cold and warm, in runs
        disk = DiskTier(root / "tier", 4 * n * block, block, segment_bytes=args.segment_bytes)
        segments = sorted((root / "tier").glob("seg-*.pdkv"))
        target = KvStore(kv, args.block_tokens, args.total_bytes, high_watermark=1.0, low_watermark=1.0)
        target.memory.fill_(0)  # pages touched first, as a running store's are
        buffer = torch.zeros(n * block, dtype=torch.uint8).numpy()  # as large as the data, pages touched
        files = [*segments, flat, dd_file]

        def prepare(cache: str) -> str:
            if cache == "cold":
                return _drop_cache(files)
            for file in files:  # every file in the page cache first
                _dd([f"if={file}", "of=/dev/null", "bs=16M"])
            return "page cache"

        def pdflow_read(run_blocks: int, count: int) -> float:
            began = time.perf_counter()
            for first in range(0, count, run_blocks):
                slots = range(first, first + run_blocks)
                outcomes = disk.get_many([slot + 1 for slot in slots], [target.slot_spans(slot) for slot in slots])
                if outcomes != [Outcome.HIT] * run_blocks:
                    raise RuntimeError(f"blocks {first + 1}.. did not read back: {outcomes}")
            return time.perf_counter() - began

        def dd_read(run_blocks: int, count: int) -> float:
            return _dd([f"if={dd_file}", "of=/dev/null", f"bs={run_blocks * block}", f"count={count // run_blocks}"])

        def plain_read(run_blocks: int, count: int) -> float:
            whole = memoryview(buffer)
            fd = os.open(flat, os.O_RDONLY)
            try:
                began = time.perf_counter()
                for offset in range(0, count * block, run_blocks * block):
                    os.preadv(fd, [whole[offset : offset + run_blocks * block]], offset)
                return time.perf_counter() - began
            finally:
                os.close(fd)

        for cache in ("cold", "warm"):
            for run_blocks in args.runs:
                count = n // run_blocks * run_blocks
                best = {"pdflow": float("inf"), "dd": float("inf"), "plain": float("inf")}
                for _ in range(args.repeats):  # interleaved, the best of each: the disk's own noise is large
                    for name, read in (("pdflow", pdflow_read), ("dd", dd_read), ("plain", plain_read)):
                        how = prepare(cache)
                        best[name] = min(best[name], read(run_blocks, count))
                read_s, dd_read_s, plain_read_s = best["pdflow"], best["dd"], best["plain"]
                row = _row(f"read {cache}", run_blocks, count * block, read_s, dd_read_s, plain_read_s, memcpy_s)
                row["cache"] = how
                results["rows"].append(row)
                print(f"read {cache} runs of {run_blocks}: pdflow {row['pdflow_GBps']:.2f} GB/s, "
                      f"dd {row['dd_GBps']:.2f} GB/s ({row['vs_dd']:.2f}x)", file=progress)
        same = torch.equal(target.memory[: n // args.runs[-1] * args.runs[-1] * block],
                           store.memory[: n // args.runs[-1] * args.runs[-1] * block])
        results["read_back_identical"] = bool(same)
        disk.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _row(what: str, run_blocks: int, nbytes: int, pdflow_s: float, dd_s: float, plain_s: float, memcpy_s: float) -> dict:
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    return {"what": what, "run_blocks": run_blocks, "bytes": nbytes, "pdflow_GBps": round(gbps(pdflow_s), 3),
            "dd_GBps": round(gbps(dd_s), 3), "plain_GBps": round(gbps(plain_s), 3),
            "memcpy_GBps": round(gbps(memcpy_s), 3), "vs_dd": round(dd_s / pdflow_s, 3),
            "vs_plain": round(plain_s / pdflow_s, 3)}


def report(results: dict) -> str:
    lines = [f"{results['blocks']} blocks of {results['block_bytes'] / (1 << 20):.2f} MiB "
             f"({results['bytes'] / (1 << 30):.2f} GiB) in {results['dir']}",
             "| what | run | pdflow GB/s | dd GB/s | plain file GB/s | memcpy GB/s | pdflow / dd | pdflow / plain |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        run = f"{row['run_blocks']} block{'s' if row['run_blocks'] > 1 else ''} " \
              f"({row['run_blocks'] * results['block_bytes'] / (1 << 20):.1f} MiB)"
        lines.append(f"| {row['what']} | {run} | {row['pdflow_GBps']:.2f} | {row['dd_GBps']:.2f} | "
                     f"{row['plain_GBps']:.2f} | {row['memcpy_GBps']:.2f} | {row['vs_dd']:.2f}x | "
                     f"{row['vs_plain']:.2f}x |")
    lines.append(f"read back identical: {results['read_back_identical']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdflow.transports.shaping import parse_size

    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (default: %(default)s)")
    p.add_argument("--total", dest="total_bytes", type=lambda s: parse_size(s, "--total"), default=1 << 30,
                   help="bytes of blocks to write and read (default: 1GiB)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default: %(default)s)")
    p.add_argument("--runs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                   help="read runs, in blocks (default: 1,4,16)")
    p.add_argument("--segment-bytes", type=lambda s: parse_size(s, "--segment-bytes"), default=256 << 20,
                   help="the tier's segment size (default: 256MiB)")
    p.add_argument("--repeats", type=int, default=3, help="reads of each kind, interleaved; the best "
                   "counts (default: %(default)s)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(report(results))
    print(f"\nrepeat: pdflow bench disk --dir {args.dir} --total {args.total_bytes} "
          f"--block-tokens {args.block_tokens} --runs {','.join(map(str, args.runs))} --repeats {args.repeats}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results["read_back_identical"] else 1
