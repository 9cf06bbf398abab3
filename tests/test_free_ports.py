"""Ports for the servers tests start (pdflow.testing.server.free_port_base): never the same run
twice in one process, each xdist worker's from a share of its own, none in Ray's worker ports or the
kernel's ephemeral range. (A parked replica binds its port only once the scaler starts it: a check
that the port is free cannot see that another server owns it.)"""

from __future__ import annotations

import collections

import pytest

from pdflow.runtime.launcher import ephemeral_port_range
from pdflow.testing import server


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    # (not the runs this worker's own servers hold)
    monkeypatch.setattr(server, "_HANDED_OUT", collections.deque(maxlen=64))


def test_a_process_never_hands_out_a_port_twice(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    runs = sorted((range(base, base + 40) for base in (server.free_port_base(40) for _ in range(60))),
                  key=lambda run: run.start)
    for earlier, later in zip(runs, runs[1:]):
        assert earlier.stop <= later.start, (earlier, later)
    assert runs[0].start >= 20000 and runs[-1].stop <= ephemeral_port_range()[0]


def test_each_xdist_worker_takes_its_ports_from_a_share_of_its_own(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    spans = []
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        bases = [server.free_port_base(11) for _ in range(20)]
        spans.append((min(bases), max(bases) + 11))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans
    assert spans[0][0] >= 20000 and spans[-1][1] <= ephemeral_port_range()[0]
