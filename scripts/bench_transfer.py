#!/usr/bin/env python3
"""Measure the KV transports between two processes: the same as ``pdflow bench transfer``.

    .venv/bin/python scripts/bench_transfer.py --json transfer.json --plot docs/img/transfer.png

Every option is listed by ``--help``; see docs/benchmarks.md for what the figures mean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not


def main() -> int:
    from pdflow.bench import transfer

    parser = argparse.ArgumentParser(
        prog="bench_transfer.py",
        description=transfer.DESCRIPTION.replace("pdflow bench transfer", "bench_transfer.py"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    transfer.add_arguments(parser)
    return transfer.main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
