"""Insert a custom stage into the default pipeline and run it as processes.

    python examples/custom_stage.py --words Paris,London     # then ask it about France

Every stage runs in its own process, as with `pdflow run`; the pipeline is built here in code
and handed to each process as is (no topology file). The pipeline gets an egress stage (by
default ingress detokenizes itself), and the redact stage sits between egress and ingress:
egress's text output goes to it, and it passes the text on with the words masked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # so that `redact` imports here and in every stage process

from redact import RedactStage  # noqa: E402

from pdflow import Pipeline, run  # noqa: E402


def build(words: list[str], port: int | None = None) -> Pipeline:
    pipeline = Pipeline.default().with_egress().with_stage(
        "redact", RedactStage, after="egress", output="text", options={"words": words},
    )
    return pipeline.with_ports(port) if port else pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", default="Paris", help="comma-separated words to redact (default: %(default)s)")
    parser.add_argument("--port", type=int, default=None,
                        help="the HTTP port; the control ports follow it (default: topology.toml's ports)")
    args = parser.parse_args()
    return run(build(args.words.split(","), args.port))


if __name__ == "__main__":
    sys.exit(main())
