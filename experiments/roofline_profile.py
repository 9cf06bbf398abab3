#!/usr/bin/env python3
"""Write a simulator profile for hardware that is not here, from its datasheet and the model's
shape (a roofline with stated efficiencies), not from a measurement:

    .venv/bin/python experiments/roofline_profile.py --out profiles/h100x8-llama-3-70b-roofline.json

A replica is ``--gpus`` GPUs in tensor parallel. Prefill is compute-bound: ``2 x parameters``
FLOPs a token plus causal attention's ``2 x layers x heads x head_dim x n^2`` for ``n`` tokens, at
``--mfu`` of the GPUs' dense peak. A decode step is memory-bound: it reads every weight and the
batch's KV once, at ``--mbu`` of the GPUs' memory bandwidth (or the compute time, if longer).
The defaults are NVIDIA's H100 SXM datasheet figures (989 TFLOP/s dense BF16, 3.35 TB/s HBM3)
and efficiencies in the range inference engines report (50% MFU in prefill, 60% bandwidth in
decode): a planning assumption, stated in the profile's ``source``, to be replaced by a
``pdflow profile`` run on the real machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdflow.bench.experiments import experiment_parser  # noqa: E402
from pdflow.plan.kv_bytes import size_of  # noqa: E402
from pdflow.plan.shapes import lookup  # noqa: E402

HEADS = {"llama-3-70b": 64, "llama-3-8b": 32, "llama-3.1-405b": 128, "qwen2.5-72b": 64, "qwen2.5-7b": 28,
         "mistral-7b": 32}


def main() -> int:
    p = experiment_parser(__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="llama-3-70b", help=f"one of {', '.join(HEADS)}")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per replica, tensor parallel (default 8)")
    p.add_argument("--tflops", type=float, default=989.0, help="dense BF16 TFLOP/s per GPU (H100 SXM: 989)")
    p.add_argument("--tb-per-s", type=float, default=3.35, help="memory bandwidth per GPU, TB/s (H100 SXM: 3.35)")
    p.add_argument("--mfu", type=float, default=0.5, help="share of peak FLOP/s prefill reaches (default 0.5)")
    p.add_argument("--mbu", type=float, default=0.6, help="share of bandwidth decode reaches (default 0.6)")
    p.add_argument("--link-gbit", type=float, default=400.0, help="KV link per replica, Gbit/s (default 400)")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--replica-start-s", type=float, default=60.0, help="a new replica's time to ready (default 60)")
    args = p.parse_args()
    shape = lookup(args.model)
    params = shape.parameters * 1e9
    flops = args.gpus * args.tflops * 1e12 * args.mfu
    bandwidth = args.gpus * args.tb_per_s * 1e12 * args.mbu
    kv_token = size_of(shape, "bf16").bytes_per_token
    width = HEADS[shape.name] * shape.head_dim

    def prefill_s(n: int) -> float:
        return (2 * params * n + 2 * shape.layers * width * n * n) / flops

    def step_s(batch: int, context: int) -> float:
        memory = (2 * params + batch * context * kv_token) / bandwidth
        compute = (2 * params * batch + 4 * shape.layers * width * context * batch) / flops
        return max(memory, compute)

    tokens = [256, 1024, 4096, 16384, 65536, 131072]
    batches, contexts = [1, 8, 32, 64, 128], [1024, 8192, 32768]
    profile = {
        "name": f"{shape.name}-{args.gpus}xH100-roofline",
        "source": (f"roofline, not measured: {args.gpus} GPUs in tensor parallel at {args.tflops:g} TFLOP/s dense BF16 "
                   f"and {args.tb_per_s:g} TB/s each (NVIDIA H100 SXM datasheet), prefill at {args.mfu:.0%} of peak "
                   f"FLOP/s, decode at {args.mbu:.0%} of memory bandwidth; {shape.name} shape from its config.json; "
                   f"BF16 weights and KV; experiments/roofline_profile.py"),
        "layers": shape.layers, "kv_bytes_per_token": kv_token,
        "prefill": {"tokens": tokens, "seconds": [prefill_s(n) for n in tokens]},
        "decode": {"batch": batches, "context": contexts,
                   "seconds": [[step_s(b, c) for b in batches] for c in contexts]},
        "link": {"gbit_per_s": args.link_gbit, "latency_s": 5e-6}, "fetch_gbit_per_s": args.link_gbit,
        "replica_start_s": args.replica_start_s, "max_batch": args.max_batch,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {args.out}: prefill of 8,192 tokens {prefill_s(8192):.3f} s, decode step (batch 64, 8K context) "
          f"{step_s(64, 8192) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
