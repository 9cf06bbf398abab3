"""Prefill's products on ``int4-a16-blocked``: sgemm on a dequantized copy (how prefill ran past
64 rows where the CPU has no AMX) against the kernels in calls of 64 rows (how it runs now where the
CPU has AMX or AVX-512 VNNI), for the default model's matrix shapes and a range of rows.

    .venv/bin/python experiments/probe_prefill_products.py --threads 1 --rows 65 128 256 512

Each product is timed alternately for ``--seconds`` at a time; prints milliseconds per product,
their ratio, and the largest difference between the two results (the kernels quantize x to 16
bits per group of 32, as a decode step does).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdflow import kernels
from pdflow.engine.weights.formats import Int4A16Blocked

SHAPES = ((1536, 576), (576, 1536), (576, 576))  # SmolLM2's MLP up/gate, down, attention's square


def _per_call_ms(product, seconds: float) -> float:
    product()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        product()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[65, 100, 128, 256, 512])
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    if kernels.library() is None:
        raise SystemExit(f"the kernels cannot be built here: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"kernel paths: {kernels.library().pdflow_q4b_paths():#b} (1 plain, 2 VNNI, 3 AMX, 4 AVX2); "
          f"{args.threads} thread(s)")
    print(f"{'outputs':>7s} {'inputs':>6s} {'rows':>5s} {'sgemm ms':>9s} {'kernels ms':>10s} {'ratio':>6s} "
          f"{'max diff':>9s}")
    for outputs, inputs in SHAPES:
        packed = Int4A16Blocked().pack(torch.randn(outputs, inputs) * 0.05)
        for rows in args.rows:
            x = torch.randn(rows, inputs)

            def dequantized():
                return F.linear(x, packed.dequantized())

            def by_kernels():
                return torch.cat([packed.matmul(x[start:start + kernels.MAX_ROWS])
                                  for start in range(0, rows, kernels.MAX_ROWS)])

            difference = (dequantized() - by_kernels()).abs().max().item()
            sgemm_ms, kernel_ms = _per_call_ms(dequantized, args.seconds), _per_call_ms(by_kernels, args.seconds)
            print(f"{outputs:7d} {inputs:6d} {rows:5d} {sgemm_ms:9.2f} {kernel_ms:10.2f} "
                  f"{sgemm_ms / kernel_ms:5.2f}x {difference:9.2e}")
    print(f"repeat: .venv/bin/python experiments/probe_prefill_products.py --threads {args.threads} "
          f"--rows {' '.join(map(str, args.rows))}")


if __name__ == "__main__":
    main()
