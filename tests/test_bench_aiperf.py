"""``pdflow bench aiperf``'s own parts: the hub cache aiperf reads the tokenizer from, and the
report read from aiperf's summary (aiperf itself and llama-server are not installed by the
suite: the benchmark runs on demand, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pdflow.bench import aiperf_compare


def test_the_tokenizer_loads_offline_by_hub_id_from_the_private_cache(model_dir, tmp_path) -> None:
    home = aiperf_compare.hub_cache(model_dir, "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "hf")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    code = ("from transformers import AutoTokenizer; "
            "t = AutoTokenizer.from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct'); print(len(t))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == 49152


def _summary(ttft: float, tokens_per_s: float, errors: int = 0) -> dict:
    return {"time_to_first_token": {"unit": "ms", "p50": ttft, "p99": ttft * 2},
            "output_token_throughput": {"unit": "tokens/sec", "avg": tokens_per_s},
            "error_summary": [{"error_details": {"type": "ServerDisconnectedError"}, "count": errors}] if errors else []}


def test_the_report_puts_each_server_side_by_side_with_pdflows_ratio() -> None:
    args = argparse.Namespace(concurrency=[4], requests=8, isl=256, osl=128)
    results = {"pdflow": {4: _summary(100.0, 80.0)}, "llama.cpp -t 2": {4: _summary(400.0, 20.0, errors=2)}}
    text = aiperf_compare.report(args, results)
    ttft = next(line for line in text.splitlines() if "TTFT p50" in line).split()
    assert ttft[-3:] == ["100.00", "400.00", "x0.250"]
    throughput = next(line for line in text.splitlines() if "output tokens/s" in line).split()
    assert throughput[-1] == "x4.000"
    assert next(line for line in text.splitlines() if "errors" in line).split()[-2:] == ["0", "2"]
    assert "ITL" not in text  # a metric neither summary has is left out, not printed as 0
