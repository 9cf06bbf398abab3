#!/usr/bin/env python
"""Speculative decoding through the whole pipeline: ``pdflow bench serve`` against the same
server without speculation and with it (``[speculative] method = "ngram"``, adaptive), one after
the other, on the multi-turn mode (chat sessions that send their answers back), the RAG mode
(documents with questions) and the multi-turn mode under load (8 sessions at once). Reported per
workload: TPOT and output tokens per second without and with, their ratio, and the draft tokens
the server reports as accepted (``usage.completion_tokens_details``).

    .venv/bin/python experiments/experiment_speculative.py --out bench-results/speculative
"""

from __future__ import annotations

import sys
from pathlib import Path

from pdflow.bench.experiments import Report, bench, experiment_parser, figure, serving

REPORT = Report()
say = REPORT.say

WORKLOADS = {
    "multi-turn": ["--dataset", "multiturn", "--sessions", "4", "--turns", "3", "--input-len", "256", "--turn-len",
                   "64", "--output-len", "64", "--think-time", "0", "--max-concurrency", "1", "--seed", "2"],
    "rag": ["--dataset", "rag", "--documents", "2", "--doc-len", "1000", "--questions", "3", "--question-len", "32",
            "--output-len", "64", "--max-concurrency", "1", "--seed", "1"],
    "multi-turn x8": ["--dataset", "multiturn", "--sessions", "8", "--turns", "3", "--input-len", "256",
                      "--turn-len", "64", "--output-len", "64", "--think-time", "0", "--max-concurrency", "8",
                      "--seed", "3"],
}
SETTINGS = {"off": "", "ngram": '\n[speculative]\nmethod = "ngram"\n'}


def part_serve(opts, out: Path) -> None:
    results: dict[str, dict[str, dict]] = {name: {} for name in WORKLOADS}
    for setting, extra in SETTINGS.items():
        with serving(mode=opts.mode, extra=extra, request_timeout_s=600) as server:
            for name, argv in WORKLOADS.items():
                say(f"- speculation {setting}: {name}")
                slug = name.replace(" ", "-")
                results[name][setting] = bench(server.url, out / f"{slug}-{setting}.json", argv)["runs"][0]["metrics"]
    say()
    say(f"pdflow ({opts.mode}), `pdflow bench serve` per workload (greedy, ignore_eos as bench serve sends it):")
    say()
    say("| workload | TPOT p50 off (ms) | on (ms) | output tok/s off | on | on / off | draft tokens accepted |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    for name, by in results.items():
        off, on = by["off"], by["ngram"]
        spec = on.get("speculation") or {}
        accepted = (f"{100 * spec['acceptance']:.1f}% ({spec['accepted']} of {spec['accepted'] + spec['rejected']})"
                    if spec else "-")
        ratio = on["output_token_throughput"] / off["output_token_throughput"] if off["output_token_throughput"] else None
        say(f"| {name} | {figure(off['tpot_ms']['p50'], '.2f')} | {figure(on['tpot_ms']['p50'], '.2f')} | "
            f"{off['output_token_throughput']:.1f} | {on['output_token_throughput']:.1f} | "
            f"{figure(ratio, '.2f')}x | {accepted} |")
    for name, argv in WORKLOADS.items():
        say(f"- {name}: `pdflow bench serve {' '.join(argv)}`")


def main(argv: list[str] | None = None) -> int:
    parser = experiment_parser(__doc__, "speculative")
    parser.add_argument("--parts", default="serve")
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    opts = parser.parse_args(argv)
    return REPORT.run("pdflow speculative decoding through the pipeline", {"serve": part_serve}, opts)


if __name__ == "__main__":
    sys.exit(main())
