"""Where a verify pass's rows go: one sequence's forward pass over 1..8 rows (what speculation's
verify pass runs, ``PagedDecodeBatch._forward_rows``) with the head timed apart, then each product
of the first layer and the head alone, from cache, by rows.

    GOMP_SPINCOUNT=300000 .venv/bin/python experiments/profile_verify_rows.py --context 400

A row's cost against a one-row step is speculation's ``row_cost`` (pdflow/speculative/speculation.py).
"""

from __future__ import annotations

import time

import torch

from pdflow.bench.experiments import experiment_parser
from pdflow.engine import Sampler, Sequence, load_model, prefill
from pdflow.engine.paged import KvPool, PagedDecodeBatch
from pdflow.kv.arena import ArenaLayout
from pdflow.messages import SamplingParams
from pdflow.models import resolve


class _TimedHead:
    def __init__(self, head):
        self.head, self.seconds = head, 0.0

    def __call__(self, x):
        began = time.perf_counter()
        y = self.head(x)
        self.seconds += time.perf_counter() - began
        return y


def _batch(loaded, context: int) -> PagedDecodeBatch:
    pool = KvPool(ArenaLayout(loaded.layout, 64, context // 64 + 4))
    batch = PagedDecodeBatch(loaded, 1, pool)
    ids = [1000 + i % 4000 for i in range(context)]
    kv = {}
    sampler = Sampler(SamplingParams(max_tokens=8, temperature=0))
    first = prefill(loaded, ids, sampler, lambda layer, k, v: kv.__setitem__(layer, (k.transpose(0, 1), v.transpose(0, 1))))
    batch.add_from(Sequence("0", len(ids), first.first_token, sampler, history=[*ids, first.first_token]), kv.__getitem__)
    return batch


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--weights", default=None)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    directory = resolve("smollm2", progress=False)
    loaded = load_model(directory, weights=opts.weights) if opts.weights else load_model(directory)
    model = loaded.model
    batch = _batch(loaded, opts.context)
    head = model.lm_head
    timed = model.lm_head = _TimedHead(head)
    print(f"verify pass of one sequence at {opts.context} tokens of context ({opts.threads} threads)")
    one = None
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 6, 8):
            for _ in range(2):  # the second round is reported (the first warms)
                timed.seconds = 0.0
                began = time.perf_counter()
                for _ in range(opts.repeat):
                    batch._forward_rows([0] * rows, list(range(rows)), [5] * rows)
                total = (time.perf_counter() - began) / opts.repeat
            one = total if rows == 1 else one
            print(f"  rows {rows}: {total * 1e3:6.2f} ms (head {timed.seconds / opts.repeat * 1e3:5.2f} ms); "
                  f"a row beyond the first: {(total - one) / max(rows - 1, 1) / one:4.2f} of a one-row pass")
    model.lm_head = head
    layer = model.layers[0]
    print("products alone, from cache")
    for name, product in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down),
                          ("lm_head", head)):
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, product.in_features)
            for _ in range(3):
                y = product(x)
            n = max(3, opts.repeat * (1 if name == "lm_head" else 10))
            began = time.perf_counter()
            for _ in range(n):
                product(x)
            seconds = (time.perf_counter() - began) / n
            macs = rows * x.shape[1] * y.shape[-1]
            print(f"  {name:8s} rows {rows:2d}: {seconds * 1e6:8.1f} us, {seconds / rows * 1e6:8.1f} us a row, "
                  f"{macs / seconds / 1e9:5.1f} GMAC/s{_by_path(product, x, n)}")
    return 0


def _by_path(product, x, n: int) -> str:
    """For int4-a16-blocked: each kernel path's time for the same product (the same results)."""
    from pdflow import kernels
    from pdflow.engine.weights.formats import _Blocked

    lib = kernels.library()
    if not isinstance(product, _Blocked) or lib is None:
        return ""
    times = []
    for path, name in ((2, "vnni"), (3, "amx"), (4, "avx2")):
        if lib.pdflow_q4b_paths() & (1 << path):
            product.matmul(x, path)
            began = time.perf_counter()
            for _ in range(n):
                product.matmul(x, path)
            times.append(f"{name} {(time.perf_counter() - began) / n * 1e6:.1f} us")
    return "; " + ", ".join(times)


if __name__ == "__main__":
    raise SystemExit(main())
