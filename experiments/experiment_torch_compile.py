#!/usr/bin/env python
"""Does ``torch.compile`` pay on this CPU? The decode step and a prefill of the compact engine,
eager against compiled, per weight format, compile time included.

For each format: the step as the decode stage runs it (KV in pool blocks where the kernel runs)
at batch 1 and 8 over a 256-token context, eager; then the same with the model's forward wrapped
in ``torch.compile`` (inductor, ``dynamic=True`` so that new positions do not recompile), with the
time of its first calls (the compilation) apart from the steady step time; and a 512-token
prefill both ways.

    .venv/bin/python experiments/experiment_torch_compile.py --weights fp32 int4-a16
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from pdflow.bench.engine import _Discard
from pdflow.bench.experiments import experiment_parser
from pdflow.engine import DecodeBatch, Sampler, Sequence, load_model
from pdflow.engine.paged import KvPool, PagedDecodeBatch
from pdflow.kv.arena import ArenaLayout
from pdflow.messages import SamplingParams
from pdflow.models import resolve


class _Compiled:
    """The model, its forward compiled: every other attribute is the model's own."""

    def __init__(self, model, forward):
        self._model, self._forward = model, forward

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _batch(loaded, size: int, context: int, steps: int):
    layout = loaded.layout
    kv = [(torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5,
           torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5) for _ in range(layout.num_layers)]
    if PagedDecodeBatch.runs(loaded):
        batch = PagedDecodeBatch(loaded, size, KvPool(ArenaLayout(layout, 64, size * -(-(context + steps + 16) // 64))))
        add = batch.add_from
    else:
        batch = DecodeBatch(loaded, size)
        add = batch.add
    for i in range(size):
        add(Sequence(str(i), context, 100 + i, Sampler(SamplingParams(max_tokens=steps + 8, temperature=0))),
            kv.__getitem__)
    return batch


def _steps(batch, steps: int) -> tuple[float, float]:
    """(the first step's time, the median of the next ``steps``)."""
    started = time.perf_counter()
    batch.step()
    first = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - started)
    return first, statistics.median(times)


def _prefill(model, tokens: int, repeats: int = 3) -> tuple[float, float]:
    ids = torch.randint(100, 40000, (1, tokens))
    positions = torch.arange(tokens)[None]
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        model(ids, positions, None, _Discard())
        times.append(time.perf_counter() - started)
    return times[0], min(times[1:])


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--weights", nargs="+", default=["fp32", "int4-a16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve("smollm2", progress=False)
    print(f"torch {torch.__version__}, {args.threads} threads; decode over {args.context}-token contexts, "
          f"median of {args.steps} steps; prefill of {args.prefill} tokens, best of 3")
    print()
    print("| weights | what | eager | compiled | compiled / eager | compiling (first call, compiled) |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.weights:
        loaded = load_model(model_dir, weights=name)
        rows = []
        for size in (1, 8):
            eager = _steps(_batch(loaded, size, args.context, args.steps * 2), args.steps)[1]
            rows.append((f"decode step b{size}", eager))
        rows.append((f"prefill {args.prefill}", _prefill(loaded.model, args.prefill)[1]))
        torch._dynamo.reset()
        compiled = dataclasses.replace(loaded, model=_Compiled(loaded.model, torch.compile(loaded.model.forward,
                                                                                             dynamic=True)))
        try:
            results = []
            for size in (1, 8):
                results.append(_steps(_batch(compiled, size, args.context, args.steps * 2), args.steps))
            results.append(_prefill(compiled.model, args.prefill))
        except Exception as exc:  # a format whose forward inductor cannot take: say so, go on
            print(f"| {name} | (compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}) | | | | |")
            continue
        for (what, eager), (first, steady) in zip(rows, results):
            print(f"| {name} | {what} | {eager * 1e3:.1f} ms | {steady * 1e3:.1f} ms | {steady / eager:.2f}x | "
                  f"{first:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
