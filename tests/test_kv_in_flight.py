"""pdflow.kv.in_flight: a later request waits for blocks an earlier one's prefill is computing,
and gives up where waiting could hold prefill idle."""

from __future__ import annotations

import asyncio

import pytest

from pdflow.kv.in_flight import InFlight


def _run(coroutine):
    return asyncio.run(coroutine)


def test_only_a_later_request_waits_for_the_first_writer_of_a_block():
    async def main():
        in_flight = InFlight()
        first = in_flight.add(1, [10, 11, 12])
        second = in_flight.add(2, [12, 13])  # block 12 has its writer already
        assert in_flight.writer_of(12, 3) is first and in_flight.writer_of(13, 3) is second
        assert in_flight.writer_of(10, 1) is None  # not itself
        assert in_flight.writer_of(13, 2) is None and in_flight.writer_of(99, 9) is None
        in_flight.done(first)
        assert first.stored.done() and in_flight.writer_of(10, 3) is None
        assert in_flight.writer_of(12, 3) is None  # (second never owned it)
        in_flight.done(second)
        in_flight.done(second)  # twice: harmless
        assert len(in_flight) == 0
    _run(main())


def test_a_waiter_goes_on_once_the_blocks_are_stored():
    async def main():
        in_flight = InFlight()
        writer = in_flight.add(1, [10])
        wanted = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(in_flight.wait(writer, wanted, 10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        in_flight.done(writer)
        assert await waiting is True
        assert (in_flight.waits, in_flight.given_up) == (1, 0)
    _run(main())


@pytest.mark.parametrize("began", [False, True])
def test_prefill_wanting_the_plan_ends_the_wait_unless_the_writer_has_begun(began):
    async def main():
        in_flight = InFlight()
        writer = in_flight.add(1, [10])
        writer.began = began
        wanted = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(in_flight.wait(writer, wanted, 10))
        await asyncio.sleep(0.05)
        wanted.set_result(None)  # prefill has got to the waiter and waits for its plan
        await asyncio.sleep(0.05)
        if began:  # the writer is being computed: it will be stored
            assert not waiting.done()
            in_flight.done(writer)
            assert await waiting is True
        else:  # it may be queued behind the waiter: compute without it
            assert await waiting is False and in_flight.given_up == 1
    _run(main())


def test_an_answer_on_its_way_is_waited_for_by_anyone_but_only_for_its_patience():
    async def main():
        in_flight = InFlight()
        answer = in_flight.add(0, [20], began=True, patience_s=0.1)
        assert in_flight.writer_of(20, 1) is answer  # any request arrived after "0"
        wanted = asyncio.get_running_loop().create_future()
        wanted.set_result(None)  # prefill waiting does not end it: the answer is computed already
        began = asyncio.get_running_loop().time()
        assert await in_flight.wait(answer, wanted, 10) is False
        assert 0.09 <= asyncio.get_running_loop().time() - began < 5 and in_flight.given_up == 1
    _run(main())


def test_a_wait_ends_at_its_deadline():
    async def main():
        in_flight = InFlight()
        writer = in_flight.add(1, [10])
        writer.began = True
        wanted = asyncio.get_running_loop().create_future()
        assert await in_flight.wait(writer, wanted, 0.1) is False
        assert in_flight.given_up == 1 and not writer.stored.done()
    _run(main())
