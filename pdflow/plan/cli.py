"""``pdflow plan``: sizes and counts for a deployment, printed as tables (``--json`` for machines).

    pdflow plan kv --model llama-3-70b --tokens 131072
    pdflow plan transfer --model llama-3-70b --tokens 8192 --gbit 25 100 400 --prefill-tokens-per-s 20000
    pdflow plan capacity --trace ../shared/traces/conversation_trace.jsonl --model llama-3-70b --plot hit.png
    pdflow plan ratio --rate 2 --input 12000 --output 340 --prefill-tokens-per-s 9000 --decode-tokens-per-s 600

Traces are Mooncake's (github.com/kvcache-ai/Mooncake, FAST25-release/traces/, Apache License 2.0):
    curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdflow.bench import traces
from pdflow.plan import capacity, kv_bytes, ratio, shapes, transfer

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    kv = sub.add_parser("kv", help="KV bytes per token and per request, per dtype and codec")
    _model(kv)
    kv.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072],
                    help="request lengths to size (default: 4096 32768 131072)")
    kv.add_argument("--block-tokens", type=int, default=64, help="the codecs' block (default: %(default)s)")
    _json(kv)
    kv.add_argument("--list-models", action="store_true", help="list the built-in models and exit")

    tr = sub.add_parser("transfer", help="time to move a prompt's KV per link speed, with and without layer "
                        "streaming")
    _model(tr)
    tr.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default: %(default)s)")
    tr.add_argument("--kv", default=None, help="KV dtype or codec (default: the model's dtype)")
    tr.add_argument("--gbit", type=float, nargs="+", default=[10, 25, 100, 400],
                    help="link speeds, decimal Gbit/s (default: 10 25 100 400)")
    tr.add_argument("--latency-us", type=float, default=0.0, help="one-way link latency (default: 0)")
    tr.add_argument("--prefill-tokens-per-s", type=float, default=None,
                    help="prefill speed, to compare with and to time streaming's tail (default: none)")
    _json(tr)

    cap = sub.add_parser("capacity", help="a trace's prefix hit ratio against the store's capacity (LRU)")
    cap.add_argument("--trace", required=True, help=traces.help_text())
    cap.add_argument("--limit", type=int, default=None, help="only its first N requests")
    cap.add_argument("--block-tokens", type=int, default=capacity.TRACE_BLOCK_TOKENS,
                     help="tokens per hash id in the trace (default: %(default)s, Mooncake's)")
    _model(cap)
    cap.add_argument("--kv", default=None, help="KV dtype or codec for sizes in bytes (default: the model's dtype)")
    cap.add_argument("--points", type=int, default=16, help="capacities on the curve (default: %(default)s)")
    cap.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw the curve (needs matplotlib)")
    _json(cap)

    rt = sub.add_parser("ratio", help="a prefill:decode split for a target load")
    rt.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    rt.add_argument("--input", type=float, default=None, help="mean prompt tokens (or --trace)")
    rt.add_argument("--output", type=float, default=None, help="mean output tokens (or --trace)")
    rt.add_argument("--trace", default=None,
                    help=traces.help_text("take the means (and the unbounded hit ratio) from this trace"))
    rt.add_argument("--hit-ratio", type=float, default=None,
                    help="share of prompt tokens the store gives (default: the trace's unbounded ratio, else 0)")
    rt.add_argument("--prefill-tokens-per-s", type=float, default=None, help="one prefill replica's throughput")
    rt.add_argument("--decode-tokens-per-s", type=float, default=None, help="one decode replica's throughput")
    rt.add_argument("--engine-report", type=Path, default=None, metavar="JSON",
                    help="take both from a `pdflow bench engine --out` report instead")
    rt.add_argument("--weights", default=None, help="which weight format of the report (default: its first)")
    rt.add_argument("--tbt-slo-ms", type=float, default=None,
                    help="with --engine-report: the largest measured batch meeting this")
    rt.add_argument("--utilization", type=float, default=0.8, help="the most of a replica to plan on "
                    "(default: %(default)s)")
    _json(rt)


def _model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"a built-in model ({', '.join(shapes.KNOWN)}) or a local model directory / config.json")


def _shape(args) -> shapes.ModelShape:
    if not args.model:
        raise ValueError(f"pdflow plan {args.plan_command}: give --model")
    return shapes.lookup(args.model)


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        report, text = _COMMANDS[args.plan_command](args)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else text)
    return 0


# --- formatting --------------------------------------------------------------------------

def size(nbytes: float | None) -> str:
    """Binary units (KiB = 1024 bytes)."""
    if nbytes is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{nbytes:.0f} B"


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _shape_line(shape: shapes.ModelShape) -> str:
    what = (f"{shape.layers} layers x {shape.kv_heads} kv heads x head_dim {shape.head_dim}, keys and values"
            if shape.attention == "gqa" else
            f"{shape.layers} layers x a {shape.head_dim}-wide MLA latent (keys and values rebuilt from it)")
    return f"{shape.name}: {what}; {shape.elements_per_token:,} KV elements per token ({shape.source})\n"


def _kv_row(kv: str | None, shape: shapes.ModelShape, block_tokens: int = 64) -> kv_bytes.KvSize:
    return kv_bytes.size_of(shape, kv or shape.default_dtype, block_tokens)


# --- commands ----------------------------------------------------------------------------

def _kv(args) -> tuple[dict, str]:
    if args.list_models:
        rows = [{"model": s.name, "layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                 "attention": s.attention, "parameters_b": s.parameters} for s in shapes.KNOWN.values()]
        text = "".join(f"{r['model']:<16} {r['layers']:>4} layers {r['kv_heads']:>3} kv heads head_dim "
                       f"{r['head_dim']:>4} {r['attention']} {r['parameters_b']}B\n" for r in rows)
        return {"models": rows}, text
    shape = _shape(args)
    rows = kv_bytes.kv_sizes(shape, args.block_tokens)
    report = {"model": shape.name, "shape": _shape_dict(shape), "rows": [
        {"kv": r.label, "bytes_per_token": r.bytes_per_token, "note": r.note,
         "bytes": {str(t): r.bytes_for(t) for t in args.tokens}} for r in rows]}
    lines = [_shape_line(shape).rstrip(),
             f"{'KV':<16} {'per token':>11}" + "".join(f" {f'{t:,} tokens':>16}" for t in args.tokens)]
    for r in rows:
        lines.append(f"{r.label:<16} {size(r.bytes_per_token):>11}"
                     + "".join(f" {size(r.bytes_for(t)):>16}" for t in args.tokens)
                     + (f"  ({r.note})" if r.note else ""))
    return report, "\n".join(lines) + "\n"


def _shape_dict(shape: shapes.ModelShape) -> dict:
    return {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "attention": shape.attention, "source": shape.source}


def _transfer(args) -> tuple[dict, str]:
    shape = _shape(args)
    row = _kv_row(args.kv, shape)
    if row.bytes_per_token is None:
        raise ValueError(f"{row.label} for {shape.name}: {row.note}")
    total = row.bytes_per_token * args.tokens
    prefill_s = None if args.prefill_tokens_per_s is None else args.tokens / args.prefill_tokens_per_s
    moves = [transfer.transfer(total, shape.layers, g, prefill_s, args.latency_us / 1e6) for g in args.gbit]
    report = {"model": shape.name, "kv": row.label, "tokens": args.tokens, "bytes": total, "prefill_s": prefill_s,
              "units": "link speeds in decimal Gbit/s (1 Gbit/s = 125,000,000 bytes/s)",
              "links": [{"gbit_per_s": m.gbit_per_s, "whole_s": m.whole_s, "per_layer_s": m.per_layer_s,
                         "streamed_tail_s": m.streamed_tail_s, "link_keeps_up": m.link_keeps_up} for m in moves]}
    lines = [_shape_line(shape).rstrip(),
             f"{args.tokens:,} tokens of {row.label} KV: {size(total)} ({total / 1e9:.3f} GB); link speeds are "
             f"decimal (1 Gbit/s = 125 MB/s)" + (f"; prefill {seconds(prefill_s)}" if prefill_s else ""),
             f"{'link':>12} {'whole KV':>11} {'one layer':>11} {'tail, not streamed':>19} {'tail, streamed':>22}"]
    for m in moves:
        streamed = seconds(m.streamed_tail_s) + ("" if prefill_s is not None else " (best)")
        lines.append(f"{m.gbit_per_s:>7g} Gb/s {seconds(m.whole_s):>11} {seconds(m.per_layer_s):>11} "
                     f"{seconds(m.whole_s):>19} {streamed:>22}")
    if prefill_s is None:
        lines.append("(best): the last layer alone, as when the link keeps up with prefill; give "
                     "--prefill-tokens-per-s for the tail at that speed")
    return report, "\n".join(lines) + "\n"


def _capacity(args) -> tuple[dict, str]:
    rows = capacity.read_trace(args.trace, args.limit)
    curve = capacity.hit_curve(rows, args.block_tokens)
    shape = shapes.lookup(args.model) if args.model else None
    per_block = None
    if shape is not None:
        row = _kv_row(args.kv, shape)
        per_block = None if row.bytes_per_token is None else row.bytes_per_token * args.block_tokens
    points = curve.points(args.points)
    report = {"trace": str(args.trace), "requests": curve.requests, "prompt_tokens": curve.prompt_tokens,
              "block_tokens": args.block_tokens, "distinct_blocks": curve.distinct_blocks,
              "unbounded_hit_ratio": curve.unbounded, "bytes_per_block": per_block,
              "blocks_for_90pct": curve.blocks_for(0.9), "blocks_for_99pct": curve.blocks_for(0.99),
              "curve": [{"blocks": b, "bytes": None if per_block is None else b * per_block, "hit_ratio": h}
                        for b, h in points]}
    def blocks(n: int) -> str:
        return f"{n:,} blocks" + (f" ({size(n * per_block)})" if per_block else "")

    lines = [f"{curve.requests:,} requests, {curve.prompt_tokens:,} prompt tokens, {curve.touches:,} block "
             f"touches of {args.block_tokens} tokens; LRU, prefix hits, by prompt tokens"
             + (f"; KV {size(per_block)} a block ({shape.name}, {_kv_row(args.kv, shape).label})" if per_block else ""),
             f"working set: {blocks(curve.distinct_blocks)}; a store that never evicts serves "
             f"{curve.unbounded:.1%} of prompt tokens",
             f"90% of that needs {blocks(curve.blocks_for(0.9))}; 99% needs {blocks(curve.blocks_for(0.99))}",
             f"{'capacity':>28} {'hit ratio':>10}"]
    lines += [f"{blocks(b):>28} {h:>10.1%}" for b, h in points]
    if args.plot:
        _plot(curve, per_block, args.plot, Path(args.trace).name)
        lines.append(f"plot: {args.plot}")
    return report, "\n".join(lines) + "\n"


def _plot(curve: capacity.HitCurve, per_block: float | None, path: Path, title: str) -> None:
    from pdflow.bench import plots

    if not plots.available():
        raise ValueError("--plot needs matplotlib: pip install matplotlib")
    plt = plots._pyplot()
    points = curve.points(64)
    xs = [b * per_block / 2**30 if per_block else b for b, _ in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [h * 100 for _, h in points], marker=".")
    ax.axhline(curve.unbounded * 100, linestyle="--", color="gray", label=f"never evicts: {curve.unbounded:.1%}")
    ax.set_xscale("log")
    ax.set_xlabel("store capacity (GiB of KV)" if per_block else "store capacity (blocks)")
    ax.set_ylabel("prompt tokens served from the store (%)")
    ax.set_title(f"Prefix hit ratio under LRU: {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    plots._save(plt, fig, path)


def _ratio(args) -> tuple[dict, str]:
    mean_in, mean_out, hit = args.input, args.output, args.hit_ratio
    if args.trace:
        rows = capacity.read_trace(args.trace)
        if not rows:
            raise ValueError(f"{args.trace}: no requests")
        mean_in = mean_in if mean_in is not None else sum(r["input_length"] for r in rows) / len(rows)
        mean_out = mean_out if mean_out is not None else sum(r.get("output_length", 0) for r in rows) / len(rows)
        hit = hit if hit is not None else capacity.hit_curve(rows).unbounded
    if mean_in is None or mean_out is None:
        raise ValueError("give --input and --output (mean tokens), or --trace")
    used = "as given"
    prefill_tps, decode_tps = args.prefill_tokens_per_s, args.decode_tokens_per_s
    if args.engine_report is not None:
        report = json.loads(args.engine_report.read_text())
        slo = None if args.tbt_slo_ms is None else args.tbt_slo_ms / 1e3
        measured_p, measured_d, used = ratio.capacities_from_engine_report(report, mean_in, slo, args.weights)
        prefill_tps = prefill_tps or measured_p
        decode_tps = decode_tps or measured_d
    if prefill_tps is None or decode_tps is None:
        raise ValueError("give --prefill-tokens-per-s and --decode-tokens-per-s, or --engine-report")
    s = ratio.split(args.rate, mean_in, mean_out, prefill_tps, decode_tps, hit or 0.0, args.utilization)
    report = {"rate": args.rate, "input_tokens": mean_in, "output_tokens": mean_out, "hit_ratio": hit or 0.0,
              "prefill_capacity_tokens_per_s": prefill_tps, "decode_capacity_tokens_per_s": decode_tps,
              "capacities_from": used, "utilization": args.utilization, "prefill": s.prefill, "decode": s.decode,
              "ratio": s.ratio, "prefill_load_tokens_per_s": s.prefill_tokens_per_s,
              "decode_load_tokens_per_s": s.decode_tokens_per_s, "prefill_utilization": s.prefill_utilization,
              "decode_utilization": s.decode_utilization}
    text = (f"load: {args.rate:g} req/s of {mean_in:,.0f} tokens in ({hit or 0:.1%} from the store) and "
            f"{mean_out:,.0f} out\n"
            f"one replica: prefill {prefill_tps:,.0f} tokens/s, decode {decode_tps:,.0f} tokens/s ({used})\n"
            f"prefill: {s.prefill_tokens_per_s:,.0f} tokens/s to compute -> {s.prefill} replicas "
            f"({s.prefill_utilization:.0%} busy)\n"
            f"decode:  {s.decode_tokens_per_s:,.0f} tokens/s to generate -> {s.decode} replicas "
            f"({s.decode_utilization:.0%} busy)\n"
            f"P:D = {s.prefill}:{s.decode} ({s.ratio}), planned at most {args.utilization:.0%} busy\n")
    return report, text


_COMMANDS = {"kv": _kv, "transfer": _transfer, "capacity": _capacity, "ratio": _ratio}
