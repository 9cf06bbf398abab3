"""Benchmarks behind ``pdflow bench``: each prints its baselines beside it, as ratios from the same
run, and the command that repeats it.

- :mod:`pdflow.bench.transfer`: ``pdflow bench transfer``, KV chunks through each transport
  between two processes, against memcpy and a plain socket.
- :mod:`pdflow.bench.kv_codecs`: ``pdflow bench kv-codecs``, each KV codec's bytes, quality cost
  and speed against uncompressed KV.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def publish(command: str, report: dict, text: str, out: Path | None) -> None:
    """Print a benchmark's ``text`` and the command that repeats it (``pdflow bench COMMAND`` and
    this run's arguments); write ``report`` as JSON to ``out`` if given."""
    sys.stdout.write(text + "\n")
    sys.stdout.write(f"repeat: pdflow bench {command} " + " ".join(sys.argv[3:]) + "\n")
    if out:
        out.write_text(json.dumps(report, indent=1))
