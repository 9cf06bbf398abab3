"""A soak on the session's shared server: many short streamed requests, a third of them aborted
by the client, none lost or failed, and afterwards nothing in flight, no lease held, and every
stage's memory, threads and open files where they were (within a stated bound).

Bounded for CI (``PDFLOW_SOAK_REQUESTS``, default 30); experiments/reliability.py runs thousands.
"""

from __future__ import annotations

import os
import time

import pytest

from pdflow.testing import faults

pytestmark = pytest.mark.e2e

REQUESTS = int(os.environ.get("PDFLOW_SOAK_REQUESTS", "30"))
RSS_DRIFT_KB = 64 * 1024  # per stage: allocator arenas settle; a leak of a request's state would not
EXTRA_THREADS = 2
EXTRA_FDS = 8


def _run(url: str, requests: int, **load) -> faults.Load:
    running = faults.Load(url, **load).start()
    try:
        while sum(running.counts().values()) < requests:
            time.sleep(0.2)
    finally:
        running.stop()
    return running


def test_a_soak_with_random_aborts_loses_nothing_and_leaks_nothing(server):
    _run(server.url, 12, clients=6, abort_ratio=0.3, max_tokens=8)  # warm up: buffers, arenas, caches
    faults.settled(server)
    before = faults.footprint(server)
    soak = _run(server.url, REQUESTS, clients=6, abort_ratio=0.3, max_tokens=8, seed=1)
    counts = soak.counts()
    assert counts["lost"] == 0 and counts["error"] == 0, [o for o in soak.outcomes if o.kind != "ok"][:3]
    assert counts["ok"] > 0 and counts["aborted"] > 0, counts
    faults.settled(server)
    after = faults.footprint(server)
    for stage, was in before.items():
        now = after[stage]
        assert now["rss_kb"] - was["rss_kb"] < RSS_DRIFT_KB, (stage, was, now)
        assert now["threads"] <= was["threads"] + EXTRA_THREADS, (stage, was, now)
        assert now["fds"] <= was["fds"] + EXTRA_FDS, (stage, was, now)
