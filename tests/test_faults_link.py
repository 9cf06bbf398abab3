"""Faults on the data plane under load: the prefill -> kv_shuttle link drops, corrupts and stalls
chunks (link emulation, seeded) while clients stream, some aborting, some reading slowly. Every
request ends whole (one whose chunk was corrupted runs again: a transient failure), or with a
clear error within its deadline (a dropped chunk: the request timeout, 8 s here; corruption past
``limits.max_migrations`` runs: at once); none is lost, and afterwards nothing is in flight and
no KV lease is held. Its own `pdflow run` (the faulty link)."""

from __future__ import annotations

import time

import pytest

from pdflow.testing import faults
from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

TIMEOUT_S = 8
LINK = {"drop": 0.01, "corrupt": 0.02, "stall": 0.03, "stall_s": 1.0, "fault_seed": 7}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, model_dir):
    with PdflowServer(tmp_path_factory.mktemp("faulty-link"), link_options=LINK,
                      request_timeout_s=TIMEOUT_S) as running:
        yield running


def test_a_link_that_drops_corrupts_and_stalls_loses_no_request(faulty):
    load = faults.Load(faulty.url, clients=4, abort_ratio=0.15, slow_ratio=0.2, max_tokens=10,
                       bound_s=TIMEOUT_S + 15).start()
    try:
        time.sleep(5)
    finally:
        outcomes = load.stop()
    counts = load.counts()
    assert counts["lost"] == 0, [o for o in outcomes if o.kind == "lost"][:3]
    migrated = faulty.health()["stages"]["ingress-0"]["stats"]["migrations"]
    assert counts["ok"] > 0 and counts["error"] + migrated > 0, counts  # the link's faults reached requests
    assert all(o.seconds < TIMEOUT_S + 10 for o in outcomes), max(o.seconds for o in outcomes)
    faults.settled(faulty, TIMEOUT_S + 20)
