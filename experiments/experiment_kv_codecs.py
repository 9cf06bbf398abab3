#!/usr/bin/env python
"""What a KV codec buys on a slow link: the whole pipeline (tcp) with both KV links (prefill ->
kv-shuttle, kv-shuttle -> decode, and the return links) emulated at ``--link-bandwidth``, once per
codec: ``int8`` on every link (the store holding decoded KV), ``store:int8`` in the store's
memory (``[kv] codec``: blocks kept encoded, so the store forwards encodings as they are), or
``decode:SPEC`` on the link into decode only (where ``head-prune`` and ``sink-window`` go).

For each link bandwidth, codec and repetition, a fresh server first serves one prompt of the same
length twice (so that the pages of the store, of decode's pool and of prefill's prefix buffer are
mapped, as on a server that has been running), then one cold ``--tokens``-token prompt (its KV streams
layer by layer to the store and on to decode while prefill computes) and then the same prompt
again, warm (its prefix, all but the last block, comes from the store: over the link to prefill,
which computes the last block's tokens, and to decode). Reported per codec: the cold prompt's KV tail (prefill's last layer computed ->
decode holds all KV) and whole transfer from its timeline, its TTFT, and the warm prompt's TTFT,
both at the client; then each as a ratio of `none`'s from the same run (the codec's own encode
and decode are inside every figure). Each warm request's line also says where its prefill went
(its plan, the cached prefix's first and last layers landing, its last layer computed).
``--prefill-cores 0,1`` pins prefill to both cores instead of core 0 (as on a host of its own);
``--block-tokens N`` sets the store's block size (a warm prompt recomputes its last block).

    .venv/bin/python experiments/experiment_kv_codecs.py --out bench-results/kv-codecs
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdflow.bench.experiments import Report, experiment_parser
from pdflow.testing.server import PdflowServer
from pdflow.timeline import kv_summary

REPORT = Report()
say = REPORT.say


def _ttft(url: str, prompt: list[int]) -> tuple[float, str]:
    """Seconds to the first streamed token of ``prompt``, and the response id."""
    started = time.monotonic()
    first, rid = None, ""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=1200,
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk.get("id", rid)
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    first = time.monotonic() - started
    if first is None:
        raise RuntimeError(f"no token came back for the {len(prompt)}-token prompt")
    return first, rid


def warm_parts(timeline: dict[str, list[float]]) -> dict[str, float]:
    """Where a warm request's prefill went, in seconds from prefill getting to it: its plan, the
    cached prefix's first and last layers landing, and the computed last layer (absent keys:
    not recorded for that request)."""
    t0 = timeline["prefill.dequeued"][0]
    parts = {"plan": timeline["prefill.plan_in"][0] - t0}
    landed = timeline.get("prefill.prefix_in")
    if landed:
        parts["first prefix layer in"], parts["last prefix layer in"] = landed[0] - t0, max(landed) - t0
    parts["last layer computed"] = timeline["prefill.layer_done"][-1] - t0
    return parts


def _prefill_on(server: PdflowServer, cores: str) -> PdflowServer:
    """``server`` (not started) with prefill pinned to ``cores`` ("0,1") instead of core 0."""
    text = server.topology.read_text()
    pinned = re.sub(r"(\[stages\.prefill\][^\[]*?)cores = \[0\]", rf"\g<1>cores = [{cores}]", text, count=1)
    if cores != "0" and pinned == text:
        raise RuntimeError("the test topology no longer pins prefill to core 0: update _prefill_on")
    server.topology.write_text(pinned)
    return server


def part_link(opts, out: Path) -> None:
    for bandwidth in opts.link_bandwidth:
        _link(opts, out, bandwidth)


def _where(codec: str, block_tokens: int = 0) -> dict:
    """PdflowServer's settings for ``codec``: ``store:SPEC`` in the store, ``decode:SPEC`` on the
    link into decode only, else ``SPEC`` on every link; ``block_tokens`` (0: the default) the
    store's block size."""
    from pdflow.kv.codecs import from_spec

    kv = {"block_tokens": block_tokens} if block_tokens else {}
    if codec.startswith("store:"):
        return {"kv": {**kv, "codec": codec[6:]}}
    if codec.startswith("decode:"):
        made = from_spec(codec[7:])
        return {"decode_codec": made.name, "decode_codec_options": made.params, "kv": kv}
    return {"codec": codec, "kv": kv}


def _link(opts, out: Path, bandwidth: str) -> None:
    link = {"bandwidth": bandwidth, "latency": opts.link_latency}
    rows: dict[str, list[dict]] = {codec: [] for codec in opts.codecs}
    for rep in range(opts.repeats):
        for codec in opts.codecs:
            where = _where(codec, opts.block_tokens)
            with tempfile.TemporaryDirectory() as tmp, _prefill_on(PdflowServer(
                Path(tmp), link_options=link, decode_link_options=link, request_timeout_s=1200, **where
            ), opts.prefill_cores) as server:
                warm_up = [(i * 6007 + rep * 7) % 40000 + 1000 for i in range(opts.tokens)]
                _ttft(server.url, warm_up)
                _ttft(server.url, warm_up)  # and its prefix from the store
                prompt = [(i * 7919 + rep * 104729) % 40000 + 1000 for i in range(opts.tokens)]
                cold, rid = _ttft(server.url, prompt)
                timeline = httpx.get(f"{server.url}/debug/timeline/{rid}", timeout=30).json()
                summary = kv_summary(timeline)
                warm, warm_rid = _ttft(server.url, prompt)
                parts = warm_parts(httpx.get(f"{server.url}/debug/timeline/{warm_rid}", timeout=30).json())
                row = {"cold_ttft_s": cold, "warm_ttft_s": warm, **summary, "warm": parts}
                rows[codec].append(row)
                say(f"- {bandwidth}, {codec}, repetition {rep + 1}: cold TTFT {cold:.2f} s, KV tail {summary['kv_tail_s'] * 1e3:.0f} ms, "
                    f"whole transfer {summary['whole_transfer_s']:.2f} s, warm TTFT {warm:.2f} s "
                    f"({', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in parts.items())})")
    (out / f"link-{bandwidth}.json").write_text(json.dumps(rows, indent=1))
    say()
    say(f"A {opts.tokens}-token prompt through emulated {bandwidth} / {opts.link_latency} KV links, "
        f"medians of {opts.repeats} (ratios: none's / the codec's, each repetition's own, min-max):")
    say()
    say("| codec | cold TTFT (s) | KV tail (ms) | whole transfer (s) | warm TTFT (s) | tail: none / codec "
        "| whole transfer | cold TTFT | warm TTFT |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = rows["none"] if "none" in rows else None

    def med(codec, key):
        return statistics.median(r[key] for r in rows[codec])

    def ratio(codec, key):
        if base is None:
            return "-"
        values = [b[key] / r[key] for b, r in zip(base, rows[codec])]
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    for codec in opts.codecs:
        say(f"| {codec} | {med(codec, 'cold_ttft_s'):.2f} | {med(codec, 'kv_tail_s') * 1e3:.0f} | "
            f"{med(codec, 'whole_transfer_s'):.2f} | {med(codec, 'warm_ttft_s'):.2f} | {ratio(codec, 'kv_tail_s')} | "
            f"{ratio(codec, 'whole_transfer_s')} | {ratio(codec, 'cold_ttft_s')} | {ratio(codec, 'warm_ttft_s')} |")


def main() -> int:
    parser = experiment_parser(__doc__, "kv-codecs")
    parser.add_argument("--parts", default="link")
    parser.add_argument("--codecs", nargs="+", default=["none", "int8", "int4", "store:int8"],
                        help="codec specs on every link, store:SPEC for the store's, decode:SPEC on the link "
                        "into decode only, e.g. decode:sink-window:window=1024 (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per codec (default: %(default)s)")
    parser.add_argument("--link-bandwidth", nargs="+", default=["1Gbit"], help="one run per bandwidth")
    parser.add_argument("--link-latency", default="0.5ms")
    parser.add_argument("--block-tokens", type=int, default=0,
                        help="the store's block size ([kv] block_tokens; default: the topology's, 64): a warm "
                        "prompt recomputes its last block")
    parser.add_argument("--prefill-cores", default="0",
                        help="the cores prefill is pinned to (default: %(default)s, as the test topology has it; "
                        "0,1: both, as on a host of its own, decode idle beside it)")
    opts = parser.parse_args()
    return REPORT.run("pdflow KV codecs on a slow link", {"link": part_link}, opts)


if __name__ == "__main__":
    sys.exit(main())
