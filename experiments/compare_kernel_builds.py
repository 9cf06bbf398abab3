"""Time int4-a16 products (one row, or ``--rows`` rows: a verify pass of speculative decoding) of
SmolLM2's layer shapes in this checkout's kernels against another build of them, alternating in
one process. The other build is a git revision's kernel sources (``pdflow/kernels/*.c``, or
``pdflow/engine/kernels/*.c`` before they moved), compiled here with this checkout's flags, or a
shared library built before:

    .venv/bin/python experiments/compare_kernel_builds.py OLD_COMMIT
    .venv/bin/python experiments/compare_kernel_builds.py /tmp/old.so

The other build's functions are declared as this checkout's pdflow_kernels.h has them (those it
lacks are left out): compare against revisions whose signatures are the same.

A layer's four products (QKV 960x576, output 576x576, gate/up 3072x576, down 576x1536) use 2.8 MB
of int4 weights, which stay in the caches: this times the kernels' arithmetic, not memory (the
decode step, which reads every layer's weights from memory, is `pdflow bench engine`). Prints the
median over rounds of the best of 30 calls, times 30 layers, and the largest difference between
the two builds' outputs (0 where the new kernel sums in the old one's order).

With ``--context N [N ...]`` it times instead what a decode step spends in C: the real model's
(SmolLM2, ``int4-a16``) 30 layers in one call into ``pdflow_decode_layers``, ``--rows`` sequences
of N cached tokens each in pool blocks as the decode stage holds them (attention included), the
builds alternating call by call; the weights and the KV (79.6 MB and 46 KB a token) are more than
the caches keep between calls, so this is the step from memory.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdflow import kernels
from pdflow.bench.experiments import experiment_parser
from pdflow.engine.weights import registry

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of a SmolLM2 layer
LAYERS = 30
KERNEL_DIRECTORIES = ("pdflow/kernels", "pdflow/engine/kernels")  # where revisions keep the C sources


def other_build(other: str) -> ctypes.CDLL:
    """The library ``other`` names: a shared library's path, or a git revision of this repository
    whose kernel sources are compiled here (with this checkout's compiler and flags)."""
    if Path(other).is_file():
        return kernels.declare(ctypes.CDLL(other), missing_ok=True)
    root = Path(__file__).resolve().parent.parent
    listing = ""
    for directory in KERNEL_DIRECTORIES:
        listing = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{other}:{directory}"],
                                 capture_output=True, text=True).stdout
        if listing:
            break
    if not listing:
        raise SystemExit(f"{other!r} is neither a file nor a revision with kernel sources in {KERNEL_DIRECTORIES}")
    with tempfile.TemporaryDirectory(prefix="pdflow-kernels-") as tmp:  # loaded, the library outlives its file
        workdir = Path(tmp)
        for name in listing.split():
            if name.endswith((".c", ".h")):
                source = subprocess.run(["git", "-C", str(root), "show", f"{other}:{directory}/{name}"],
                                        capture_output=True, check=True).stdout
                (workdir / name).write_bytes(source)
        target = workdir / "kernels.so"
        kernels.compile_library(kernels._compiler() or "cc", sorted(workdir.glob("*.c")), target)
        return kernels.declare(ctypes.CDLL(str(target)), missing_ok=True)


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("other", help="a git revision whose kernels to build, or a shared library built before")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="rows of x per product (default: %(default)s)")
    parser.add_argument("--context", type=int, nargs="+", help="time the model's decode layers at these contexts")
    opts = parser.parse_args()
    builds = {"this checkout": kernels.library(), opts.other: other_build(opts.other)}
    if builds["this checkout"] is None:
        raise SystemExit(f"pdflow's kernels are not available: {kernels.unavailable_reason()}")
    torch.set_num_threads(opts.threads)
    if opts.context:
        return compare_layers(builds, opts)
    torch.manual_seed(0)
    matrices = [registry.load("int4-a16")().pack(torch.randn(n, k)) for n, k in SHAPES]
    inputs = {k: torch.randn(opts.rows, k) for _, k in SHAPES}

    def layer(lib, outputs: list[torch.Tensor]) -> None:
        for (n, k), packed, y in zip(SHAPES, matrices, outputs):
            lib.pdflow_q4a16_gemm(inputs[k].data_ptr(), opts.rows, k, packed.q.data_ptr(), packed.scales.data_ptr(),
                                  packed.lows.data_ptr(), n, y.data_ptr(), opts.threads)

    outputs = {name: [torch.empty(opts.rows, n) for n, _ in SHAPES] for name in builds}
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(opts.rounds):
        for name, lib in builds.items():
            best = float("inf")
            for _ in range(30):
                start = time.perf_counter()
                layer(lib, outputs[name])
                best = min(best, time.perf_counter() - start)
            times[name].append(best * LAYERS)
    nbytes = LAYERS * sum(p.q.numel() + 8 * p.scales.numel() for p in matrices)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: {LAYERS} layers of int4-a16 products, {opts.rows} row(s): {median * 1e3:.2f} ms "
              f"({nbytes / median / 1e9:.1f} GB/s of weights, from cache)")
    first, second = times.values()
    print(f"other / this checkout: {statistics.median(second) / statistics.median(first):.2f}x")
    a, b = outputs.values()
    difference = max(float((x - y).abs().max()) for x, y in zip(a, b))
    print(f"largest difference between the builds' outputs: {difference:.3g} "
          f"(largest output {max(float(x.abs().max()) for x in a):.3g})")
    return 0


def compare_layers(builds: dict, opts) -> int:
    """The model's decode layers at each context, the builds alternating call by call."""
    from pdflow.engine import Sampler, Sequence, load_model
    from pdflow.engine.paged import KvPool, PagedDecodeBatch, _PagedCache
    from pdflow.kv.arena import ArenaLayout
    from pdflow.messages import SamplingParams
    from pdflow.models import resolve

    loaded = load_model(resolve("smollm2", progress=False), weights="int4-a16")
    model, layout = loaded.model, loaded.layout
    for context in opts.context:
        kv = [(torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5,
               torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5) for _ in range(layout.num_layers)]
        blocks = (-(-(context + 16) // 64) + 1) * opts.rows
        batch = PagedDecodeBatch(loaded, opts.rows, KvPool(ArenaLayout(layout, 64, blocks)))
        for i in range(opts.rows):
            sampler = Sampler(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            batch.add_from(Sequence(str(i), context, 100 + i, sampler), kv.__getitem__)
        width = max(len(s) for s in batch.slots)
        table = torch.tensor([s + [0] * (width - len(s)) for s in batch.slots], dtype=torch.int64)
        lengths = torch.full((opts.rows,), context + 1, dtype=torch.int64)
        positions = torch.full((opts.rows,), context, dtype=torch.int64)
        cache = _PagedCache(batch.pool, lengths, table, batch._lib, None).blocks()
        start_hidden = torch.randn(opts.rows, model.embed.shape[1])
        outputs, times = {}, {name: [] for name in builds}

        def call(lib) -> torch.Tensor:
            model.fused.lib = lib
            hidden = start_hidden.clone()
            model._native_step(hidden, positions, cache, layout.num_layers)
            return hidden

        for _ in range(3):
            for name, lib in builds.items():
                outputs[name] = call(lib)
        for _ in range(opts.rounds * 10):
            for name, lib in builds.items():
                started = time.perf_counter()
                call(lib)
                times[name].append(time.perf_counter() - started)
        model.fused.lib = builds["this checkout"]
        for name, values in times.items():
            print(f"{name}: decode layers, {opts.rows} row(s) at {context} tokens: "
                  f"{statistics.median(values) * 1e3:.3f} ms (median of {len(values)})")
        first, second = (statistics.median(v) for v in times.values())
        a, b = outputs.values()
        print(f"other / this checkout at {context} tokens: {second / first:.2f}x; largest difference between the "
              f"builds' outputs: {float((a - b).abs().max()):.3g} (largest output {float(a.abs().max()):.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
