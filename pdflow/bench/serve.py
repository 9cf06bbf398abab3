"""``pdflow bench serve``: load an OpenAI-compatible server and report TTFT, TBT, TPOT, E2E,
throughput and goodput, measured on the client from the SSE stream (in the spirit of
``vllm bench serve``). Works against any such server; ``--timelines`` adds pdflow's own
per-request stage timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

from pdflow import client_key
from pdflow.bench import serve_report as report
from pdflow.bench import traces
from pdflow.bench.prompts import PromptBuilder, Tokenizer
from pdflow.bench.workloads import DATASETS, WorkloadSpec, block_size, build, build_sessions, parse_range

# httpx, the runner and matplotlib are imported by main(), so that `pdflow --help` and
# `pdflow run` do not pay for them (nor need httpx, which comes with the `bench` extra).

RETOKENIZE_TOKENS = 50_000  # prompt tokens decoded and tokenized again to measure the drift


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers or inf separated by commas, got {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("request rates must be positive")
    return rates


def _span(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers) -> None:
    """Add ``serve`` to a ``bench`` sub-command's subparsers."""
    p = subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server; report latency, throughput and goodput",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    _arguments(p)
    p.set_defaults(bench_main=main)


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (token-id prompts, exact counts) or /v1/chat/completions (text)")
    client_key.add_argument(g, "OPENAI_API_KEY")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send the ignore_eos extension (outputs may then end early)")
    g.add_argument("--text-prompts", action="store_true",
                   help="send prompts to /v1/completions as text, for servers without token-id prompts")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="fixed",
                   help="fixed, random, trace (Mooncake JSONL), jsonl, rag (documents x questions), "
                   "multiturn (chat sessions that re-send their history with the model's answers)")
    g.add_argument("--dataset-path", help=traces.help_text("the trace (Mooncake JSONL) or jsonl file"))
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests for fixed/random (default 16); for trace/jsonl the same as --limit")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed)")
    g.add_argument("--output-len", type=int, default=32, help="output tokens (fixed; jsonl default)")
    g.add_argument("--input-len-range", type=_span, metavar="A:B", help="random: prompt tokens, inclusive")
    g.add_argument("--output-len-range", type=_span, metavar="A:B", help="random: output tokens, inclusive")
    g.add_argument("--token-scale", type=float, default=1.0,
                   help="trace: multiply lengths and the 512-token block by this (e.g. 0.05)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: replay this many times faster (2: twice as fast, 0.5: half speed)")
    g.add_argument("--limit", type=int, help="trace/jsonl: only the first N requests")
    g.add_argument("--sample-conversations", type=int, metavar="N",
                   help="trace: every request of N conversations picked at random (--seed), a "
                   "conversation being the requests that share their first two hash ids")
    g.add_argument("--tokenizer", default="smollm2",
                   help="a Hugging Face directory or known model name (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="for lengths, prompts and arrivals")
    g.add_argument("--documents", type=int, default=4, help="rag: documents (default: %(default)s)")
    g.add_argument("--doc-len", type=int, default=3000, help="rag: tokens per document (default: %(default)s)")
    g.add_argument("--questions", type=int, default=4, help="rag: questions per document (default: %(default)s)")
    g.add_argument("--question-len", type=int, default=32, help="rag: tokens per question (default: %(default)s)")
    g.add_argument("--sessions", type=int, default=8, help="multiturn: chat sessions (default: %(default)s)")
    g.add_argument("--turns", type=int, default=4, help="multiturn: turns per session (default: %(default)s)")
    g.add_argument("--turn-len", type=int, default=64,
                   help="multiturn: tokens of each new message after the first (--input-len) (default: %(default)s)")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="multiturn: seconds between an answer and the next turn (default: %(default)s)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rates, metavar="R[,R...]",
                   help="Poisson arrivals per second, 'inf' = all at once; several (0.5,1,2) run in "
                   "turn, each with fresh prompt tokens (same lengths) so no run hits another's cache. "
                   "Default: the trace's timestamps for trace, else inf")
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g.add_argument("--cache-block-tokens", type=int,
                   help="block size of the unbounded-cache bound (default: the pdflow server's "
                   "kv.block_tokens from /health, else 64)")

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT, ms")
    g.add_argument("--slo-tbt", type=float, help="goodput SLO on TBT (Mooncake's: mean of longest 10%% gaps), ms")
    g.add_argument("--result-json", help="write every metric and per-request record here")
    g.add_argument("--plot-dir", help="write PNG plots here (needs matplotlib)")
    g.add_argument("--timelines", action="store_true", help="fetch pdflow's /debug/timeline/{id} per request")
    g.add_argument("--save-prompts", action="store_true", help="keep each prompt in the result records")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of ``pdflow bench serve``, standalone (for scripts and tests)."""
    p = argparse.ArgumentParser(prog="pdflow bench serve", description=__doc__)
    _arguments(p)
    return p.parse_args(argv)


def reproduce(args: argparse.Namespace) -> str:
    """The command line that repeats this run (options that differ from their defaults)."""
    defaults = vars(parse_args([]))
    words = ["pdflow", "bench", "serve"]
    for key, value in vars(args).items():
        if key not in defaults or value == defaults[key] or key in ("api_key", "api_key_env", "bench_main"):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple):
            words += [flag, f"{value[0]}:{value[1]}"]
        elif isinstance(value, list):
            words += [flag, ",".join(f"{v:g}" for v in value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _first_model(args) -> tuple[str, int | None]:
    import httpx

    headers = client_key.headers(args.api_key)
    try:
        body = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).raise_for_status().json()
        card = body["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        if args.model:  # a server without /v1/models still works when told the name
            return args.model, None
        raise
    return args.model or card["id"], card.get("max_model_len")


def _workload(args, seed_suffix: str = ""):
    from pdflow.models import resolve

    tokenizer = Tokenizer(resolve(args.tokenizer, progress=sys.stderr.isatty()))
    num = args.num_prompts if args.num_prompts is not None else 16
    spec = WorkloadSpec(args.dataset, num, args.input_len, args.output_len, args.input_len_range,
                        args.output_len_range, args.dataset_path, args.token_scale, args.time_scale,
                        args.limit if args.limit is not None else args.num_prompts, args.seed,
                        args.documents, args.doc_len, args.questions, args.question_len, args.sessions,
                        args.turns, args.turn_len, args.think_time, args.sample_conversations)
    builder = PromptBuilder(tokenizer, f"{args.seed}{seed_suffix}")
    return spec, builder, build(spec, builder)


def describe(spec: WorkloadSpec, builder: PromptBuilder, requests) -> dict:
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    generated, budget = [], RETOKENIZE_TOKENS
    for r in requests if spec.dataset != "jsonl" else []:
        if budget <= 0:
            break
        generated.append(r.prompt)
        budget -= len(r.prompt)
    drift = [builder.retokenize_error(ids) for ids in generated]
    info = {"dataset": spec.dataset, "path": spec.path, "requests": len(requests), "seed": spec.seed,
            "input_len": {"mean": statistics.fmean(ins), "min": min(ins), "max": max(ins)},
            "output_len": {"mean": statistics.fmean(outs), "min": min(outs), "max": max(outs)}}
    if spec.dataset == "trace":
        info |= {"token_scale": spec.token_scale, "time_scale": spec.time_scale,
                 "block_tokens": block_size(spec.token_scale), "sample_conversations": spec.sample_conversations}
    if spec.dataset == "rag":
        info |= {"documents": spec.documents, "doc_len": spec.doc_len, "questions": spec.questions,
                 "question_len": spec.question_len}
    if spec.dataset == "multiturn":
        info |= {"sessions": spec.sessions, "turns": spec.turns, "first_len": spec.input_len,
                 "turn_len": spec.turn_len, "think_time_s": spec.think_time_s,
                 "note": "input_len counts first turns only; later turns grow with the answers"}
    if drift:
        info["retokenize_error"] = {
            "sampled": len(drift), "mean_abs_tokens": statistics.fmean(abs(d) for d in drift),
            "max_abs_tokens": max(abs(d) for d in drift),
            "mean_abs_fraction": statistics.fmean(abs(d) / len(ids) for d, ids in zip(drift, generated))}
    return info


def _server_block_tokens(args) -> int | None:
    """A pdflow server's ``kv.block_tokens``, from the store's stats in ``/health``."""
    import httpx

    try:
        stages = httpx.get(f"{args.base_url}/health", timeout=10).json().get("stages", {})
    except (httpx.HTTPError, ValueError):
        return None
    return next((s["stats"]["block_tokens"] for s in stages.values() if "block_tokens" in s.get("stats", {})), None)


def main(args: argparse.Namespace) -> int:
    """Run ``pdflow bench serve`` with parsed ``args``; 0 when any request completed."""
    args.api_key = client_key.api_key(args)
    try:
        import httpx

        from pdflow.bench import plots
        from pdflow.bench.metrics import summarize
        from pdflow.bench.serve_runner import Target, run, run_sessions, schedule
    except ImportError as exc:
        sys.stderr.write(f"error: {exc}; install the benchmark's dependencies: pip install httpx\n")
        return 1
    import structlog

    from pdflow.log import configure_logging

    configure_logging("console", "info")
    log = structlog.get_logger()
    args.base_url = args.base_url.rstrip("/")
    try:
        model, max_len = _first_model(args)
        spec, builder, requests = _workload(args)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, OSError) as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    if not requests:
        sys.stderr.write("error: the workload has no requests\n")
        return 1
    if max_len and (too_long := sum(r.prompt_len + r.output_len > max_len for r in requests)):
        log.warning("bench.context.exceeded", requests=too_long, max_model_len=max_len)
    workload = describe(spec, builder, requests)
    target = Target(args.base_url, model, args.endpoint, not args.no_ignore_eos, args.text_prompts,
                    args.timeout, args.api_key)
    rates = args.request_rate or [None if args.dataset == "trace" else math.inf]
    block_tokens = args.cache_block_tokens or _server_block_tokens(args) or 64
    runs = []
    for k, rate in enumerate(rates):
        if k:  # fresh prompt tokens, same lengths and prefix structure
            spec, builder, requests = _workload(args, f".{k}")
        label = report.label(rate, args.max_concurrency, spec)
        arrivals = schedule(requests, rate, args.seed)
        if spec.dataset == "multiturn":  # the rate starts sessions; each runs its turns in turn
            records, duration = asyncio.run(run_sessions(
                target, build_sessions(spec, builder), builder, arrivals, spec.think_time_s,
                args.max_concurrency, not args.no_progress, label))
        else:
            records, duration = asyncio.run(run(target, requests, builder, arrivals, args.max_concurrency,
                                                args.timelines, args.save_prompts, not args.no_progress, label))
        metrics = summarize(records, duration, args.slo_ttft, args.slo_tbt, block_tokens)
        runs.append({"label": label, "request_rate": "inf" if rate == math.inf else rate,
                     "max_concurrency": args.max_concurrency, "metrics": metrics,
                     "records": [r.to_json() for r in records]})
        sys.stdout.write(report.table(label, metrics))
    if len(runs) > 1:
        sys.stdout.write(report.sweep(runs))
    command = reproduce(args)
    sys.stdout.write(f"reproduce: {command}\n")
    result = {"command": command, "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
              "ignore_eos": target.ignore_eos, "workload": workload, "runs": runs, "plots": []}
    if args.plot_dir:
        if plots.available():
            result["plots"] = [str(p) for p in plots.write_all(runs, Path(args.plot_dir))]
            sys.stdout.write(f"plots: {', '.join(result['plots'])}\n")
        else:
            log.warning("bench.plots.skipped", reason="matplotlib is not installed (pip install matplotlib)")
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result, indent=1))
        sys.stdout.write(f"results: {args.result_json}\n")
    return 0 if any(run["metrics"]["completed"] for run in runs) else 1  # failures are in the report
