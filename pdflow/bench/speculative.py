"""``pdflow bench speculative``: decoding with and without speculation, side by side, on the same
prompts: acceptance, mean accepted length, time per output token and tokens per second, at batch 1
and at a larger batch (under load), and whether the greedy outputs are identical.

Workloads (greedy, ``--tokens`` output tokens each, stopping at end of sequence as a server does):

- **rag**: "answer from this passage, quoting it": passages of English prose with a question;
- **rewrite**: "rewrite this paragraph, keeping its wording" and "summarize", over passages;
- **multiturn**: a second turn that asks the model to repeat its first answer with a change
  (the first answer, generated here, is in the prompt, as in a chat that quotes itself);
- **chat**: free-form chat prompts (``pdflow bench engine``'s), where little repeats.

The passages: the documentation topics Python ships in its standard library
(``pydoc_data.topics``, the Python Software Foundation License). Each workload runs on one
engine (the model's default weights unless ``--weights``), in the paged batch a server's decode
uses, prefill excluded from the times, ``--batches`` sequences at a time: each group of prompts
without speculation and with it, one after the other (the order alternating from group to group,
so both see the same machine). The ratio is the speculative runs' tokens per second over the plain
runs', from the same process.

Then each workload's plain answers are replayed through the same proposer and adaptation at the
costs of a verified row that ``--row-costs`` names (:mod:`pdflow.bench.speculative_replay`): what
speculation would give on a machine whose verify rows cost that much against a one-row step (a
GPU's cost a few percent), labelled as a model and set beside the ratio measured here.
"""

from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = __doc__
WORKLOADS = ("rag", "rewrite", "multiturn", "chat")
ROW_COST_NOTE = "0.21-0.31 with the default int4-a16-blocked weights, 0.4 with int4-a16; docs/benchmarks.md"


def passages(count: int, words: int = 90) -> list[tuple[str, str]]:
    """``count`` (topic, paragraph) pairs of about ``words`` words from Python's documentation topics."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        cut = text.split(" ")[:words]
        if len(cut) == words:
            found.append((name, " ".join(cut)))
        if len(found) == count:
            break
    return found


def workload_texts(name: str, count: int) -> list[str]:
    """The user messages of workload ``name`` (multiturn's first turns; see :func:`prompts`)."""
    if name == "rag":
        return [f"Answer the question from the passage, quoting the passage's own words.\n\nPassage: {text}\n\n"
                f"Question: What does the passage say about {topic}?" for topic, text in passages(count)]
    if name == "rewrite":
        return [(f"Rewrite this paragraph in plain English, keeping its wording where you can:\n\n{text}" if i % 2 == 0
                 else f"Summarize this paragraph:\n\n{text}") for i, (_, text) in enumerate(passages(count))]
    if name == "multiturn":
        return [f"Explain in a few sentences what this is about:\n\n{text}" for _, text in passages(count)]
    raise ValueError(f"unknown workload {name!r}")


def prompts(name: str, count: int, tokenizer, loaded, tokens: int) -> list[list[int]]:
    """Tokenized prompts of workload ``name``."""
    from pdflow.bench.engine import chat_prompts

    if name == "chat":
        return chat_prompts(tokenizer, count)
    template = tokenizer.apply_chat_template
    if name != "multiturn":
        return [template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                         return_dict=False) for text in workload_texts(name, count)]
    firsts = [[{"role": "user", "content": text}] for text in workload_texts(name, count)]
    first_ids = [template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in firsts]
    answers, _ = decode(loaded, first_ids, tokens, None, batch=8)
    return [template(m + [{"role": "assistant", "content": tokenizer.decode(a, skip_special_tokens=True)},
                          {"role": "user", "content": "Say that again, word for word, but start with 'In short:'."}],
                     add_generation_prompt=True, tokenize=True, return_dict=False)
            for m, a in zip(firsts, answers)]


def decode(loaded, prompt_ids: list[list[int]], tokens: int, speculation, batch: int) -> tuple[list[list[int]], dict]:
    """Greedy answers (up to ``tokens`` each, ending at end of sequence) of ``prompt_ids``,
    ``batch`` at a time, and the decode time, steps and speculation counts (``speculation``: a
    factory of :class:`~pdflow.speculative.Speculation`, or None)."""
    answers, stats = [], {}
    for start in range(0, len(prompt_ids), batch):
        out, counts = _decode_group(loaded, prompt_ids[start : start + batch], tokens, speculation)
        answers += out
        for key, value in counts.items():
            stats[key] = stats.get(key, 0) + value
    return answers, stats


def decode_pair(loaded, prompt_ids: list[list[int]], tokens: int, speculation, batch: int):
    """:func:`decode` without and with ``speculation``, group by group, alternating which goes
    first, so that both see the same machine (this VM's speed drifts by tens of percent over
    minutes). Returns ``(plain answers, plain stats, speculative answers, speculative stats)``."""
    results = {None: ([], {}), speculation: ([], {})}
    for g, start in enumerate(range(0, len(prompt_ids), batch)):
        for mode in ((None, speculation) if g % 2 == 0 else (speculation, None)):
            out, counts = _decode_group(loaded, prompt_ids[start : start + batch], tokens, mode)
            results[mode][0].extend(out)
            for key, value in counts.items():
                results[mode][1][key] = results[mode][1].get(key, 0) + value
    return (*results[None], *results[speculation])


def _decode_group(loaded, prompt_ids: list[list[int]], tokens: int, speculation) -> tuple[list[list[int]], dict]:
    """One batch of ``prompt_ids`` decoded together until every answer ends."""
    import torch

    from pdflow.engine import Sampler, Sequence, prefill
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout
    from pdflow.messages import SamplingParams

    block = 64
    longest = max(map(len, prompt_ids)) + tokens + block
    pool = KvPool(ArenaLayout(loaded.layout, block, len(prompt_ids) * -(-longest // block)))
    engine = PagedDecodeBatch(loaded, len(prompt_ids), pool)
    engine.speculation = speculation() if speculation is not None else None
    answers: list[list[int]] = [[] for _ in prompt_ids]
    for i, ids in enumerate(prompt_ids):
        sampler = Sampler(SamplingParams(max_tokens=tokens, temperature=0))
        kv = {}
        first = prefill(loaded, ids, sampler, lambda layer, k, v, kv=kv: kv.__setitem__(
            layer, (k.transpose(0, 1), v.transpose(0, 1))))
        seq = Sequence(str(i), len(ids), first.first_token, sampler, history=[*ids, first.first_token])
        answers[i].append(first.first_token)
        engine.add_from(seq, kv.__getitem__)
    seconds, steps = 0.0, 0
    with torch.inference_mode():
        while engine.sequences:
            began = time.perf_counter()
            results = engine.step()
            seconds += time.perf_counter() - began
            steps += 1
            done = set()
            for seq, token in results:
                out = answers[int(seq.request_id)]
                if seq in done:
                    continue
                out.append(token)
                if len(out) >= tokens or token in loaded.eos_token_ids:
                    done.add(seq)
            for seq in done:
                engine.remove(seq)
    counts = dict(engine.speculation.counts) if engine.speculation is not None else {}
    generated = sum(len(a) - 1 for a in answers)  # the first token of each came from prefill
    return answers, {"seconds": seconds, "steps": steps, "tokens": generated, **counts}


def run(args: argparse.Namespace, progress=sys.stderr) -> dict:
    import torch

    from pdflow.engine import load_model, load_tokenizer
    from pdflow.models import resolve
    from pdflow.bench.speculative_replay import replay
    from pdflow.speculative import Speculation, proposer

    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model, progress=False)
    loaded = load_model(model_dir, weights=args.weights) if args.weights else load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    options = dict(item.split("=", 1) for item in args.option)
    options = {key: int(value) for key, value in options.items()}

    def speculation(row_cost: float = args.row_cost):
        return Speculation(proposer(args.method, loaded, **options), args.num_tokens, not args.fixed,
                           row_cost=row_cost)

    report = {"model": args.model, "weights": args.weights or "default", "method": args.method,
              "num_tokens": args.num_tokens, "adaptive": not args.fixed, "options": options, "tokens": args.tokens,
              "prompts": args.prompts, "rows": {}, "replays": {}}
    for name in args.workloads:
        progress.write(f"{name}: prompts ...\n")
        ids = prompts(name, args.prompts, tokenizer, loaded, args.tokens)
        decode(loaded, ids[:1], 8, None, 1)  # warm up
        answers = None  # the plain answers of the first batch size (the replays' answers)
        for batch in args.batches:
            progress.write(f"{name}: batch {batch}, without and with speculation ...\n")
            plain_out, plain, spec_out, spec = decode_pair(loaded, ids, args.tokens, speculation, batch)
            report["rows"][f"{name}@{batch}"] = {
                "workload": name, "batch": batch, "plain": plain, "speculative": spec,
                "identical": sum(a == b for a, b in zip(plain_out, spec_out)), "answers": len(ids),
                "prompt_tokens": sum(map(len, ids)) / len(ids)}
            answers = plain_out if answers is None else answers
        if args.row_costs:  # the run's own cost first: its replay sits beside the measured ratio
            costs = [args.row_cost, *(c for c in args.row_costs if c != args.row_cost)]
            report["replays"][name] = {
                str(cost): replay(ids, answers, speculation(cost), args.tokens, loaded.max_context)
                for cost in costs}
    return report


def table(report: dict) -> str:
    head = (f"{'workload':10s} {'batch':>5s} {'prompt':>6s} {'accept':>7s} {'mean kept':>9s} {'TPOT off':>9s} "
            f"{'TPOT on':>8s} {'tok/s off':>9s} {'tok/s on':>9s} {'on/off':>7s} {'steps off/on':>13s} {'same':>7s}")
    # mean kept: draft tokens kept per verify of a sequence's draft (its accepted length)
    lines = [f"speculative decoding ({report['method']}, {report['num_tokens']} tokens, "
             f"{'adaptive' if report['adaptive'] else 'fixed'}) on {report['model']} ({report['weights']} weights); "
             f"{report['prompts']} prompts x up to {report['tokens']} tokens, greedy", head, "-" * len(head)]
    for row in report["rows"].values():
        plain, spec = row["plain"], row["speculative"]
        rate_off, rate_on = plain["tokens"] / plain["seconds"], spec["tokens"] / spec["seconds"]
        accept = spec["accepted"] / spec["proposed"] if spec["proposed"] else 0.0
        kept = spec["accepted"] / spec["drafts"] if spec.get("drafts") else 0.0
        lines.append(f"{row['workload']:10s} {row['batch']:5d} {row['prompt_tokens']:6.0f} {100 * accept:6.1f}% "
                     f"{kept:9.2f} "
                     f"{1e3 / rate_off:8.2f}m {1e3 / rate_on:7.2f}m {rate_off:9.1f} {rate_on:9.1f} "
                     f"{rate_on / rate_off:6.2f}x {plain['steps']:6d}/{spec['steps']:<6d} "
                     f"{row['identical']:3d}/{row['answers']:<3d}")
    lines.append("accept: draft tokens kept / proposed; mean kept: draft tokens kept per draft verified (the "
                 "accepted length); TPOT: decode seconds per output token (m = ms), over the batch's tokens; "
                 "steps: the batch's decode steps; same: greedy answers identical with and without speculation")
    if report.get("replays"):
        lines += ["", *replay_table(report)]
    return "\n".join(lines)


def replay_table(report: dict) -> list[str]:
    """The replays beside the measured batch-1 ratio: on/off by the cost of a verified row."""
    costs = list(next(iter(report["replays"].values())))
    head = f"{'workload':10s} {'measured':>8s} " + " ".join(f"{'c=' + c:>8s}" for c in costs)
    lines = ["replayed at batch 1 (a model: a step verifying d draft tokens costs 1 + c*d one-row steps; "
             "the real proposer and adaptation over the plain answers)", head, "-" * len(head)]
    for name, by_cost in report["replays"].items():
        row = report["rows"].get(f"{name}@1")
        if row:
            on, off = row["speculative"], row["plain"]
            measured = f"{(on['tokens'] / on['seconds']) / (off['tokens'] / off['seconds']):7.2f}x"
        else:
            measured = f"{'-':>8s}"
        lines.append(f"{name:10s} {measured:>8s} " + " ".join(f"{by_cost[c]['ratio']:7.2f}x" for c in costs))
    lines.append("measured: tokens/s on/off at batch 1 in this run, whose adaptation took the first c; c: a verified "
                 f"row's cost against a one-row step (this machine's, measured: {ROW_COST_NOTE})")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", default=None, help="the weight format (default: the model's default)")
    p.add_argument("--method", default="ngram", help="the proposer (default: %(default)s)")
    p.add_argument("--num-tokens", type=int, default=5, help="draft tokens at most (default: %(default)s)")
    p.add_argument("--fixed", action="store_true", help="always draft --num-tokens (no adaptation)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=INT",
                   help="a proposer option, e.g. --option max_n=3 (repeatable)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--prompts", type=int, default=16, help="prompts per workload (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens at most (default: %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    from pdflow.config.pipeline import SpeculativeConfig  # (the topology's default; imports no torch)

    p.add_argument("--row-cost", type=float, default=SpeculativeConfig().row_cost, metavar="C",
                   help="the adaptation's cost of a verified row against a one-row step (the topology's "
                        "speculative.row_cost; default: %(default)s)")
    p.add_argument("--row-costs", type=float, nargs="*", default=[0.4, 0.2, 0.1, 0.05, 0.0], metavar="C",
                   help="also replay each workload's plain answers through the proposer at these costs of a "
                        "verified row against a one-row step (a model, pdflow.bench.speculative_replay; "
                        "none: skip; default: 0.4 0.2 0.1 0.05 0)")
    p.add_argument("--out", type=__import__("pathlib").Path, help="also write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    from pdflow.bench import publish

    report = run(args)
    publish("speculative", report, table(report), args.out)
    return 0
