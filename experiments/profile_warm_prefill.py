"""Where a warm turn's prefill goes: ``prefill()`` of the tokens after a cached prefix, in this
process, one thread, against a cold prefill of the whole prompt, with PyTorch's profiler.

    taskset -c 0 .venv/bin/python experiments/profile_warm_prefill.py --cached 1024 --total 1100

Time in pdflow's C kernels (e.g. turning int4 matrices into fp32 for sgemm) is invisible to the
profiler: it shows as the gap between the profiled total and the wall time.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import profile

from pdflow.bench.experiments import experiment_parser
from pdflow.engine import Sampler, load_model, prefill
from pdflow.messages import SamplingParams
from pdflow.models import resolve


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--weights", default="int4-a16")
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--total", type=int, default=1100)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(resolve("smollm2"), "float32", "cpu", opts.weights)
    ids = list(range(1000, 1000 + opts.total))
    greedy = SamplingParams(max_tokens=1, temperature=0)
    kv = {}
    prefill(loaded, ids[: opts.cached], Sampler(greedy), lambda layer, k, v: kv.__setitem__(layer, (k.clone(), v.clone())))

    def warm() -> float:
        start = time.perf_counter()
        prefill(loaded, ids, Sampler(greedy), lambda *_: None, kv.__getitem__, opts.cached)
        return time.perf_counter() - start

    print(f"warm: {opts.total - opts.cached} tokens after {opts.cached}:",
          [round(warm() * 1e3) for _ in range(4)], "ms")
    start = time.perf_counter()
    prefill(loaded, ids, Sampler(greedy), lambda *_: None)
    print(f"cold: {opts.total} tokens: {(time.perf_counter() - start) * 1e3:.0f} ms")
    with profile() as prof:
        wall = warm()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"wall of the profiled warm prefill: {wall * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
