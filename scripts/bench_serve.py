#!/usr/bin/env python
"""Run `pdflow bench serve` without the `pdflow` command (same arguments; see --help).

    .venv/bin/python scripts/bench_serve.py --base-url http://127.0.0.1:8000 \
        --dataset trace --dataset-path ../shared/traces/conversation_trace.jsonl \
        --token-scale 0.05 --time-scale 20 --limit 200 --slo-ttft 2000 --slo-tbt 300 \
        --result-json bench.json --plot-dir bench-plots
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from pdflow.bench.serve import main, parse_args  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(parse_args()))
