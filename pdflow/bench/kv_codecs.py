"""``pdflow bench kv-codecs``: for each KV codec, the bytes it saves, the quality it costs and its
speed, against uncompressed KV on the same tokens, from one run.

Quality, with the model's weights in fp32 so that only the KV differs:

- **agree / same**: chat prompts (10 tasks x 20 subjects) are prefilled, their KV goes through the
  codec block by block (encoded and decoded as a link or a store tier would), and the uncompressed
  KV's greedy answer is fed after it (teacher forcing): agree is the share of positions where the
  codec's KV gives the same top-1 next token as the uncompressed KV, same the answers whose every
  position agrees (with compressed KV the greedy answer would be identical).
- **KL**: the mean KL divergence of the next-token distribution, uncompressed || compressed, over
  the same positions.
- **ppl@N, agree@N, KL@N**: held-out English text, each window's first N tokens (``--context``)
  prefilled and passed through the codec, the next ``--scored`` tokens scored with that past:
  perplexity, and agreement and KL against the same window with uncompressed KV; ``--long`` adds
  windows with a 4,096-token past (where a sink + window codec drops tokens). The text: the
  documentation topics Python ships in its standard library (``pydoc_data.topics``, the Python
  Software Foundation License), those in the second half of the sorted topic names (the first
  half is what ``pdflow bench kv-heads`` calibrates head pruning on).

Structural codecs are measured as decode uses them: a sink + window codec's past is the tokens it
keeps, at their own positions, the scored tokens after the whole prompt; a head-pruning codec's
pruned heads put out zeros at every scored position. Bytes per token are keys and values of every
layer in full blocks, for a 4,096-token prompt; speed is encode + decode of a 4,096-token
chunk of every layer on one thread (median of 7), beside a memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pdflow.testing.reference import Past

DESCRIPTION = __doc__
DEFAULT_CODECS = ("none", "int8", "int8:symmetric=0", "int4", "int4:symmetric=1",
                  "int4:key_group=32,value_group=32")


def held_out_text() -> str:
    """English prose (Python's documentation topics, PSF licence) not used for calibration."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return "\n\n".join(topics[name] for name in names[len(names) // 2:])


def compressed(codec, keys, values, block_tokens: int) -> Past:
    """``keys`` and ``values`` (per layer, token-major ``(tokens, kv_heads, head_dim)``) after a
    trip through ``codec`` as the link into decode takes it: the blocks it keeps, encoded and
    decoded block by block, and the kv heads it keeps."""
    import torch
    from pdflow.kv.layout import KEYS, VALUES

    tokens, kv_heads = keys[0].shape[:2]
    kept = codec.kept_blocks(tokens, block_tokens)
    index = None
    if len(kept) * block_tokens < tokens:  # tokens dropped: the kept blocks, in order
        index = torch.cat([torch.arange(b * block_tokens, min((b + 1) * block_tokens, tokens)) for b in kept])
    out = ([], [])
    for kind, tensors in ((KEYS, keys), (VALUES, values)):
        for layer, x in enumerate(tensors):
            x = x if index is None else x.index_select(0, index)
            if codec.lossless:
                out[kind].append(x)
                continue
            back = x.new_empty(x.shape)
            codec.decode_run(codec.encode_run(x.contiguous(), kind, block_tokens, layer), kind, back, block_tokens,
                             layer)
            out[kind].append(back)
    masks = [codec.kept_heads(layer, kv_heads) for layer in range(len(keys))]
    kv_keep = None if all(m is None for m in masks) else \
        torch.tensor([m if m is not None else [True] * kv_heads for m in masks])
    return Past(out[KEYS], out[VALUES], tokens, kv_keep)


class _PrunedCache:
    """An accumulating cache whose pruned kv heads hold zero values (their query heads put out
    zeros), as decode's kernels attend with a pruning codec."""

    def __init__(self, cache, kv_keep):
        self.cache, self.kv_keep = cache, kv_keep

    def update(self, key_states, value_states, layer_idx: int, **kw):
        keys, values = self.cache.update(key_states, value_states, layer_idx, **kw)
        pruned = ~self.kv_keep[layer_idx]
        if pruned.any():
            keys, values = keys.clone(), values.clone()
            keys[:, pruned] = 0
            values[:, pruned] = 0
        return keys, values


def prompt_kv(loaded, ids: list[int]):
    """Per layer, the keys and values of ``ids`` prefilled (token-major)."""
    import torch
    from pdflow.engine.chunked import AccumulatingCache

    cache = AccumulatingCache(loaded.num_layers)
    loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], None, cache)
    return ([k[0].transpose(0, 1) for k in cache.keys], [v[0].transpose(0, 1) for v in cache.values])


def logits_after(loaded, past: Past, ids: list[int]):
    """Next-token logits at every position of ``ids`` fed after ``past`` (its tokens at their own
    positions, ``ids`` from ``past.length`` on; pruned heads put out zeros)."""
    import torch
    from pdflow.engine.chunked import AccumulatingCache
    from pdflow.engine.forward import causal_mask
    from pdflow.kv.layout import torch_dtype

    cached = past.keys[0].shape[0]
    cache = AccumulatingCache(loaded.num_layers)
    cache.keys = [k.transpose(0, 1)[None] for k in past.keys]
    cache.values = [v.transpose(0, 1)[None] for v in past.values]
    mask = causal_mask(cached, cached + len(ids), loaded.device, torch_dtype(loaded.layout.dtype))
    positions = torch.arange(past.length, past.length + len(ids))[None]
    model_cache = cache if past.kv_keep is None else _PrunedCache(cache, past.kv_keep)
    return loaded.model(torch.tensor([ids]), positions, mask, model_cache, every_position=True)[0]


def codec_speed(codec, layout, tokens: int = 4096, block_tokens: int = 64, repeats: int = 7) -> dict:
    """Encode and decode GB/s of every layer's keys and values of ``tokens`` tokens on this thread
    (a codec may treat layers differently: head pruning copies only where it prunes), and memcpy's
    of the same bytes."""
    import torch
    from pdflow.bench.engine import median_time
    from pdflow.kv.layout import KEYS, VALUES

    x = torch.randn(tokens, layout.num_kv_heads, layout.head_dim)
    back = torch.empty_like(x)
    layers = range(layout.num_layers)

    def best(fn):
        return median_time(fn, repeats, warmup=1)

    def encode_all(kind):
        return [codec.encode_run(x, kind, block_tokens, layer) for layer in layers]

    def decode_all(kind, data):
        for layer in layers:
            codec.decode_run(data[layer], kind, back, block_tokens, layer)

    copy = best(lambda: back.copy_(x))
    encode = decode = 0.0
    for kind in (KEYS, VALUES):
        data = encode_all(kind)
        encode += best(lambda: encode_all(kind))
        decode += best(lambda: decode_all(kind, data))
    raw = 2 * x.nbytes * len(layers)
    return {"encode_gbs": raw / encode / 1e9, "decode_gbs": raw / decode / 1e9,
            "both_gbs": raw / (encode + decode) / 1e9, "memcpy_gbs": x.nbytes / copy / 1e9}


def run(args: argparse.Namespace, progress=sys.stderr) -> dict:
    import torch
    import torch.nn.functional as F

    from pdflow.bench.engine import chat_prompts, greedy_answers
    from pdflow.engine import load_model, load_tokenizer
    from pdflow.kv.codecs import from_spec
    from pdflow.models import resolve

    torch.set_num_threads(args.threads)
    codecs = {spec: from_spec(spec) for spec in args.codecs}
    model_dir = resolve(args.model, progress=False)
    loaded = load_model(model_dir, weights=args.weights)
    layout = loaded.layout
    tokenizer = load_tokenizer(model_dir)
    bt = args.block_tokens
    report: dict = {"model": args.model, "weights": args.weights, "block_tokens": bt, "prompts": args.prompts,
                    "tokens": args.tokens, "codecs": {}}
    fp32_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 4
    for spec, codec in codecs.items():
        codec.check_model(layout.num_layers, layout.num_kv_heads)
        torch.set_num_threads(1)
        speed = codec_speed(codec, layout, block_tokens=bt)
        torch.set_num_threads(args.threads)
        report["codecs"][spec] = {"bytes_per_token": bytes_per_token(codec, layout, bt, BYTES_AT),
                                  "fp32_bytes_per_token": fp32_token, **speed,
                                  "kl": [], "agree": 0, "positions": 0, "same": 0, "nll": {}, "scored": {},
                                  "agree_at": {}, "kl_at": {}}
    rows = report["codecs"]

    prompts = chat_prompts(tokenizer, args.prompts) if args.prompts else []
    if prompts:
        progress.write(f"greedy answers of {len(prompts)} prompts with uncompressed KV ...\n")
        answers = greedy_answers(loaded, prompts, args.tokens)
        for i, (ids, answer) in enumerate(zip(prompts, answers)):
            if i % 20 == 0:
                progress.write(f"prompt {i + 1}/{len(prompts)} ...\n")
            keys, values = prompt_kv(loaded, ids)
            reference = F.log_softmax(logits_after(loaded, Past(keys, values, len(ids)), answer[:-1]).float(), dim=-1)
            for spec, codec in codecs.items():
                row = rows[spec]
                logp = reference if _exact(codec, keys, bt) else F.log_softmax(
                    logits_after(loaded, compressed(codec, keys, values, bt), answer[:-1]).float(), dim=-1)
                kl = (reference.exp() * (reference - logp)).sum(-1)
                agree = int((logp.argmax(-1) == reference.argmax(-1)).sum())
                row["kl"].append(float(kl.mean()))
                row["agree"] += agree
                row["positions"] += logp.shape[0]
                row["same"] += agree == logp.shape[0]

    text_ids = tokenizer.encode(held_out_text()) if args.windows else []
    for context, windows in ((args.context, args.windows), (4096, args.long_windows if args.long else 0)):
        span = context + args.scored
        for w in range(min(windows, len(text_ids) // span)):
            progress.write(f"perplexity: {context}-token past, window {w + 1}/{windows} ...\n")
            ids = text_ids[w * span:(w + 1) * span]
            keys, values = prompt_kv(loaded, ids[:context])
            targets = torch.tensor(ids[context + 1:])
            reference = F.log_softmax(logits_after(loaded, Past(keys, values, context), ids[context:-1]).float(), -1)
            for spec, codec in codecs.items():
                logp = reference if _exact(codec, keys, bt) else F.log_softmax(
                    logits_after(loaded, compressed(codec, keys, values, bt), ids[context:-1]).float(), dim=-1)
                row, c = rows[spec], str(context)
                row["nll"][c] = row["nll"].get(c, 0.0) + float(F.nll_loss(logp, targets, reduction="sum"))
                row["scored"][c] = row["scored"].get(c, 0) + len(targets)
                row["agree_at"][c] = row["agree_at"].get(c, 0) + int((logp.argmax(-1) == reference.argmax(-1)).sum())
                row["kl_at"][c] = row["kl_at"].get(c, 0.0) + float((reference.exp() * (reference - logp)).sum())
    for row in rows.values():
        row["kl_mean"] = statistics.fmean(row["kl"]) if row["kl"] else None
        row["agreement"] = row["agree"] / row["positions"] if row["positions"] else None
        row["ppl"] = {c: float(torch.exp(torch.tensor(row["nll"][c] / row["scored"][c]))) for c in row["nll"]}
        row["agreement_at"] = {c: row["agree_at"][c] / row["scored"][c] for c in row["agree_at"]}
        row["kl_mean_at"] = {c: row["kl_at"][c] / row["scored"][c] for c in row["kl_at"]}
        del row["kl"], row["agree_at"], row["kl_at"]
    return report


BYTES_AT = 4096  # bytes per token are given for a prompt this long (what sink + window keeps depends on it)


def bytes_per_token(codec, layout, block_tokens: int, tokens: int = BYTES_AT) -> float:
    """Bytes ``codec`` sends per prompt token of a ``tokens``-token prompt, keys and values of
    every layer (the blocks it keeps, each encoded)."""
    from pdflow.kv.layout import KEYS, VALUES

    kept = codec.kept_blocks(tokens, block_tokens)
    kept_tokens = sum(min(block_tokens, tokens - b * block_tokens) for b in kept)
    per_token = sum(codec.encoded_bytes(block_tokens, kind, layout.num_kv_heads, layout.head_dim, layout.itemsize, layer)
                    for layer in range(layout.num_layers) for kind in (KEYS, VALUES)) / block_tokens
    return per_token * kept_tokens / tokens


def _exact(codec, keys, block_tokens: int) -> bool:
    """Does ``codec`` give decode exactly the uncompressed KV of this prompt?"""
    tokens, kv_heads = keys[0].shape[:2]
    return codec.lossless and len(codec.kept_blocks(tokens, block_tokens)) * block_tokens >= tokens \
        and all(codec.kept_heads(layer, kv_heads) is None for layer in range(len(keys)))


def table(report: dict) -> str:
    rows = report["codecs"]
    contexts = sorted({c for r in rows.values() for c in r["ppl"]}, key=int)
    width = max([34, *(len(spec) + 1 for spec in rows)])
    head = (f"{'codec':{width}s} {'B/token':>8s} {'vs fp32':>8s} {'vs fp16':>8s} {'agree':>8s} {'same':>5s} "
            f"{'KL':>9s}" + "".join(f" {'ppl@' + c:>9s} {'agree@' + c:>11s} {'KL@' + c:>9s}" for c in contexts)
            + f" {'enc GB/s':>9s} {'dec GB/s':>9s} {'both':>6s} {'memcpy':>7s}")
    lines = [f"KV codecs on {report['model']} ({report['weights']} weights), {report['block_tokens']}-token blocks; "
             f"{report['prompts']} prompts x {report['tokens']} tokens", head, "-" * len(head)]
    for spec, r in rows.items():
        fp32 = r["fp32_bytes_per_token"]
        agree = f"{100 * r['agreement']:7.2f}%" if r["agreement"] is not None else f"{'-':>8s}"
        kl = f"{r['kl_mean']:9.5f}" if r["kl_mean"] is not None else f"{'-':>9s}"
        lines.append(f"{spec:{width}s} {r['bytes_per_token']:8.0f} {fp32 / r['bytes_per_token']:7.2f}x "
                     f"{fp32 / 2 / r['bytes_per_token']:7.2f}x {agree} {r['same']:5d} {kl}"
                     + "".join(f" {r['ppl'].get(c, float('nan')):9.3f} {100 * r['agreement_at'].get(c, float('nan')):10.2f}%"
                               f" {r['kl_mean_at'].get(c, float('nan')):9.5f}" for c in contexts)
                     + f" {r['encode_gbs']:9.2f} {r['decode_gbs']:9.2f} {r['both_gbs']:6.2f} {r['memcpy_gbs']:7.1f}")
    lines.append(f"B/token: bytes sent per token of a {BYTES_AT}-token prompt (sink-window keeps part of it); agree: "
                 "teacher-forced top-1 agreement with uncompressed KV over the chat answers; same: answers identical; "
                 "KL: mean KL(uncompressed || codec) of the next-token distribution; ppl@N, agree@N, KL@N: over "
                 "held-out text with an N-token past through the codec; GB/s: fp32 bytes per second on one thread "
                 "(enc + dec: both)")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path | None:
    """Bytes per token against KL and agreement, with the longest past measured (where a sink +
    window codec drops tokens) when there is one, else over the chat answers."""
    from pdflow.bench import plots

    if not plots.available():
        return None
    plt = plots._pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    contexts = sorted({c for r in report["codecs"].values() for c in r["agreement_at"]}, key=int)
    where = f"{contexts[-1]}-token past" if contexts else "chat answers"
    for spec, r in report["codecs"].items():
        kl = r["kl_mean_at"].get(contexts[-1]) if contexts else r["kl_mean"]
        agree = r["agreement_at"].get(contexts[-1]) if contexts else r["agreement"]
        if kl is None or agree is None:
            continue
        x, label = r["bytes_per_token"] / 1024, _label(spec)
        if kl > 0:  # lossless: no point on a log scale
            left.scatter(x, kl)
            left.annotate(label, (x, kl), fontsize=7)
        right.scatter(x, 100 * agree)
        right.annotate(label, (x, 100 * agree), fontsize=7)
    left.set(xlabel="KV KiB per token", ylabel="mean KL (uncompressed || codec)", yscale="log",
             title=f"bytes against quality ({where})")
    right.set(xlabel="KV KiB per token", ylabel="top-1 agreement (%)", title=f"bytes against agreement ({where})")
    return plots._save(plt, fig, path)


def _label(spec: str) -> str:
    """A codec spec, short enough for a plot: file paths by their name, no parameter names."""
    name, _, params = spec.partition(":")
    values = [value.rsplit("/", 1)[-1] for _, _, value in (item.partition("=") for item in params.split(",") if item)]
    return name + (" " + ",".join(values) if values else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", default="fp32", help="the weight format (default: %(default)s, so only the KV differs)")
    p.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS),
                   help="codec specs, e.g. int8 or int4:key_group=32 (default: %(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=200, help="chat prompts; 0 skips agreement and KL (default: 200)")
    p.add_argument("--tokens", type=int, default=64, help="answer tokens per prompt (default: %(default)s)")
    p.add_argument("--windows", type=int, default=16, help="perplexity windows; 0 skips perplexity (default: 16)")
    p.add_argument("--context", type=int, default=512, help="past tokens per perplexity window (default: 512)")
    p.add_argument("--scored", type=int, default=256, help="tokens scored per window (default: %(default)s)")
    p.add_argument("--long", action="store_true", help="also windows with a 4,096-token past")
    p.add_argument("--long-windows", type=int, default=4, help="windows with --long (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    p.add_argument("--plot", type=Path, help="draw bytes per token against KL and agreement (PNG, needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    from pdflow.bench import publish

    report = run(args)
    publish("kv-codecs", report, table(report), args.out)
    if args.plot and plot(report, args.plot) is None:
        sys.stderr.write("no plot: matplotlib is not installed\n")
    return 0
