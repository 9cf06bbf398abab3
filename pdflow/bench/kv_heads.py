"""``pdflow bench kv-heads``: how much each kv head of a model matters, measured on calibration
text, written as the importance file the ``head-prune`` KV codec reads (``calibration = FILE``).

Methods:

- ``kl`` (default): each kv head pruned alone, as decode prunes it (its KV dropped, its query
  heads' output zero), over windows of calibration text: the mean KL divergence of the
  next-token distribution from the unpruned model's over the scored tokens. What pruning that
  head costs, measured directly (one forward per head and window).
- ``key-norm``: the mean L2 norm of the head's keys over the calibration tokens (a cheap proxy
  from one forward; no claim that it ranks as well: ``pdflow bench kv-codecs`` compares them).

The calibration text: the documentation topics Python ships in its standard library
(``pydoc_data.topics``, the Python Software Foundation License), those in the first half of the
sorted topic names (``pdflow bench kv-codecs`` measures on the second half).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DESCRIPTION = __doc__


def calibration_text() -> str:
    from pydoc_data.topics import topics

    names = sorted(topics)
    return "\n\n".join(topics[name] for name in names[: len(names) // 2])


def run(args: argparse.Namespace, progress=sys.stderr) -> dict:
    import torch
    import torch.nn.functional as F

    from pdflow.bench.kv_codecs import Past, compressed, logits_after, prompt_kv
    from pdflow.engine import load_model, load_tokenizer
    from pdflow.kv.codecs import codec
    from pdflow.models import resolve

    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model, progress=False)
    loaded = load_model(model_dir, weights=args.weights)
    layout = loaded.layout
    ids = load_tokenizer(model_dir).encode(calibration_text())
    span = args.context + args.scored
    windows = min(args.windows, len(ids) // span)
    if windows < 1:
        raise SystemExit(f"the calibration text holds no window of {span} tokens")
    layers, kv_heads = layout.num_layers, layout.num_kv_heads
    importance = [[0.0] * kv_heads for _ in range(layers)]
    started = time.monotonic()
    for w in range(windows):
        window = ids[w * span : (w + 1) * span]
        keys, values = prompt_kv(loaded, window[: args.context])
        if args.method == "key-norm":
            for layer in range(layers):
                norms = keys[layer].float().norm(dim=-1).mean(dim=0)  # (kv_heads,)
                for head in range(kv_heads):
                    importance[layer][head] += float(norms[head]) / windows
            continue
        fed = window[args.context : -1]
        reference = F.log_softmax(logits_after(loaded, Past(keys, values, args.context), fed).float(), dim=-1)
        for layer in range(layers):
            progress.write(f"window {w + 1}/{windows}, layer {layer + 1}/{layers} "
                           f"({time.monotonic() - started:.0f} s) ...\n")
            for head in range(kv_heads):
                pruned = codec("head-prune", pruned=f"{layer}.{head}")
                logp = F.log_softmax(logits_after(loaded, compressed(pruned, keys, values, args.block_tokens), fed)
                                     .float(), dim=-1)
                kl = float((reference.exp() * (reference - logp)).sum(-1).mean())
                importance[layer][head] += kl / windows
    return {"model": args.model, "weights": args.weights, "method": args.method, "windows": windows,
            "context": args.context, "scored": args.scored,
            "text": "pydoc_data.topics, first half of the sorted topic names (Python Software Foundation License)",
            "importance": importance}


def table(report: dict) -> str:
    importance = report["importance"]
    ranked = sorted((v, layer, head) for layer, row in enumerate(importance) for head, v in enumerate(row))
    lines = [f"kv head importance of {report['model']} ({report['method']}, {report['windows']} windows of "
             f"{report['context']} + {report['scored']} tokens)",
             "layer " + " ".join(f"{'head ' + str(h):>10s}" for h in range(len(importance[0])))]
    for layer, row in enumerate(importance):
        lines.append(f"{layer:5d} " + " ".join(f"{v:10.5f}" for v in row))
    least = ", ".join(f"{layer}.{head}" for _, layer, head in ranked[:10])
    lines.append(f"least important first: {least} ...")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", default="fp32", help="the weight format (default: %(default)s)")
    p.add_argument("--method", choices=("kl", "key-norm"), default="kl", help="how importance is measured "
                   "(default: %(default)s)")
    p.add_argument("--windows", type=int, default=4, help="calibration windows (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="past tokens per window (default: %(default)s)")
    p.add_argument("--scored", type=int, default=64, help="tokens scored per window (default: %(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the importance file here (the head-prune codec's calibration)")


def main(args: argparse.Namespace) -> int:
    from pdflow.bench import publish

    report = run(args)
    publish("kv-heads", report, table(report), None)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0
