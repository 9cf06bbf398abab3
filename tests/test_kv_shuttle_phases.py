"""kv-shuttle's record of a request moves through its phases along one table, and only along it."""

from __future__ import annotations

import asyncio

import pytest

from pdflow.messages import KvDestination, KvExpected, KvInPlace, Route
from pdflow.stages.kv_shuttle import _NEXT, Phase, _Entry


@pytest.fixture
def entry():
    loop = asyncio.new_event_loop()
    yield lambda: _Entry(KvExpected("r", [1, 2, 3], Route()), loop.create_future())
    loop.close()


def test_a_request_moves_through_its_phases_in_order_only(entry) -> None:
    entry = entry()
    assert entry.phase is Phase.PLANNING
    with pytest.raises(RuntimeError, match="from planning to in store"):
        entry.enter(Phase.IN_STORE)  # nothing leased yet, nothing landed
    for phase in (Phase.RECEIVING, Phase.PROMPT_IN, Phase.IN_STORE):
        entry.enter(phase)
        assert entry.phase is phase
    with pytest.raises(RuntimeError, match="from in store to answering"):
        entry.enter(Phase.ANSWERING)  # decode wrote its answer into the request's own blocks: none comes back
    with pytest.raises(RuntimeError):
        entry.enter(Phase.RECEIVING)  # no way back
    assert entry.phase is Phase.IN_STORE


def test_every_phase_is_reached_from_planning_and_the_last_ones_end_there() -> None:
    reached, frontier = {Phase.PLANNING}, [Phase.PLANNING]
    while frontier:
        for after in _NEXT[frontier.pop()]:
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(Phase)
    assert _NEXT[Phase.IN_STORE] == _NEXT[Phase.ANSWERING] == ()


def test_decode_attends_here_only_once_it_said_so_in_place(entry) -> None:
    elsewhere, here, cancelled = entry(), entry(), entry()
    assert not here.attends_here
    elsewhere.decode_destination.set_result(KvDestination("r", "tcp://x", 1, 64))
    here.decode_destination.set_result(KvInPlace("r", 10))
    assert here.attends_here and not elsewhere.attends_here
    cancelled.decode_destination.cancel()
    assert not cancelled.attends_here
