"""Time int4-a16 products (one row, or ``--rows`` rows: a verify pass of speculative decoding) of SmolLM2's layer shapes in this checkout's kernels against
another build of qgemm.c (e.g. one compiled from an earlier commit), alternating in one process.

    git show OLD:pdflow/engine/kernels/qgemm.c > /tmp/old.c
    gcc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/old.so /tmp/old.c -lm
    .venv/bin/python scripts/compare_kernel_builds.py /tmp/old.so

A layer's four products (QKV 960x576, output 576x576, gate/up 3072x576, down 576x1536) use 2.8 MB
of int4 weights, which stay in the caches: this times the kernels' arithmetic, not memory (the
decode step, which reads every layer's weights from memory, is `pdflow bench engine`). Prints the
median over rounds of the best of 30 calls, times 30 layers, and the largest difference between
the two builds' outputs (0 where the new kernel sums in the old one's order).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from pdflow.engine import kernels
from pdflow.engine.weights import registry

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of a SmolLM2 layer
LAYERS = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="a shared library built from another qgemm.c")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="rows of x per product (default: %(default)s)")
    opts = parser.parse_args()
    builds = {"this checkout": kernels.library(), opts.other: kernels._declare(ctypes.CDLL(opts.other))}
    if builds["this checkout"] is None:
        raise SystemExit(f"pdflow's kernels are not available: {kernels.unavailable_reason()}")
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


if __name__ == "__main__":
    raise SystemExit(main())
