#!/usr/bin/env python
"""How long `pdflow run` takes from its start to every replica ready (GET /health 200), with
stages forked from the fork server (the default) beside stages spawned (``PDFLOW_STAGE_START=spawn``),
alternating, ``--repeats`` times each; then the time a killed decode replica takes to be ready again.

    .venv/bin/python experiments/bench_startup.py --repeats 5
"""

from __future__ import annotations

import os
import statistics
import time

from pdflow.bench.experiments import experiment_parser, serving
from pdflow.testing import faults


def ready_after(mode: str, restart: bool) -> tuple[float, float | None]:
    os.environ["PDFLOW_STAGE_START"] = mode
    began = time.monotonic()
    with serving() as server:
        up = time.monotonic() - began
        back = None
        if restart:
            old = faults.kill9(server, "decode-0")
            killed = time.monotonic()
            if faults.wait_replaced(server, "decode-0", old, 120) is not None:
                back = time.monotonic() - killed
        return up, back


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    results: dict[str, list[tuple[float, float | None]]] = {"forkserver": [], "spawn": []}
    for _ in range(opts.repeats):
        for mode in results:
            results[mode].append(ready_after(mode, restart=True))
            up, back = results[mode][-1]
            print(f"{mode:<10} ready after {up:5.2f} s; a killed decode ready again after "
                  f"{'-' if back is None else f'{back:.2f}'} s", flush=True)
    print()
    print("| stages | pipeline ready (median s) | killed decode ready again (median s) |")
    print("|---|---:|---:|")
    medians = {}
    for mode, runs in results.items():
        up = statistics.median(u for u, _ in runs)
        backs = [b for _, b in runs if b is not None]
        medians[mode] = up
        print(f"| {mode} | {up:.2f} | {statistics.median(backs):.2f} |" if backs else f"| {mode} | {up:.2f} | - |")
    print(f"\nforkserver / spawn: {medians['forkserver'] / medians['spawn']:.2f}x the time to ready")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
