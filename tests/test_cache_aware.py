"""Cache-aware routing: the stores' journals, their reports to ingress (KvHoldings) and ingress's
picture of them, the cache_aware router's estimate, a conversation that keeps hitting its prefix
on one of two kv-shuttle replicas, and turns sent away from their prefix that fetch it from the
store holding it (or compute it, where that store lacks it or never answers) (in one process:
LocalPipeline)."""

from __future__ import annotations

import asyncio

import pytest

from pdflow.kv.holdings import Holdings, Journal, pack_ids, short_id, unpack_ids
from pdflow.routing import ReplicaStatus, RoutingRequest, create
from pdflow.testing.local_http import openai_client
from pdflow.testing.routers import AwayRouter


def test_a_journal_nets_out_what_came_and_went_between_drains() -> None:
    journal = Journal()
    journal.add(1)
    journal.add(2)
    journal.remove(2)  # came and went: neither
    journal.remove(3)  # held before the last drain: removed
    assert journal.drain() == ({1}, {3})
    journal.remove(1)
    journal.add(1)  # dropped and indexed again (a new version): added
    assert journal.drain() == ({1}, set()) and journal.drain() == (set(), set())


def test_ids_travel_as_their_low_64_bits() -> None:
    ids = [2**127 + 5, 7, 2**64 - 1]
    assert list(unpack_ids(pack_ids(ids))) == [short_id(i) for i in ids] == [5, 7, 2**64 - 1]
    with pytest.raises(ValueError):
        unpack_ids(b"\x00" * 9)


def test_ingress_picture_follows_reports_and_drops_a_replica_after_a_gap() -> None:
    held = Holdings()
    ids = [10, 11, 12, 13]
    assert held.apply("kv_shuttle", 0, 0, True, pack_ids(ids[:2]), b"")
    assert held.prefix_blocks("kv_shuttle", 0, ids) == 2
    assert held.apply("kv_shuttle", 0, 1, False, pack_ids([12]), pack_ids([10]))
    assert held.prefix_blocks("kv_shuttle", 0, ids) == 0  # the first block went: no prefix from the start
    assert held.prefix_blocks("kv_shuttle", 0, ids[1:]) == 2
    assert not held.apply("kv_shuttle", 0, 5, False, pack_ids([10]), b"")  # seq 2..4 missing
    assert not held.known("kv_shuttle", 0)
    assert not held.apply("kv_shuttle", 0, 6, False, pack_ids([10]), b"")  # still: until a full report
    assert held.apply("kv_shuttle", 0, 7, True, pack_ids(ids), b"") and held.prefix_blocks("kv_shuttle", 0, ids) == 4
    assert not held.apply("kv_shuttle", 0, 8, False, b"\x01\x02", b"")  # junk: forgotten, not raised
    assert not held.known("kv_shuttle", 0)


def test_a_store_journals_what_it_indexes_and_evicts() -> None:
    import torch

    from pdflow.kv.layout import KvLayout
    from pdflow.kv.store import KvStore

    kv = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")
    store = KvStore(kv, 4, 3 * 2 * kv.block_bytes(4) * 2, high_watermark=1.0, low_watermark=1.0)
    store.journal = Journal()
    blocks = [torch.zeros(4, 1, 4)] * 2
    slots = store.layout.num_slots
    for i in range(slots):
        store.put([100 + i], blocks, blocks)
    added, removed = store.journal.drain()
    assert added == set(store.block_ids()) == {100 + i for i in range(slots)} and removed == set()
    store.put([200], blocks, blocks)  # the store is full: a reported block makes room
    added, removed = store.journal.drain()
    assert store.stats().evictions == 1 and added == {200}
    assert len(removed) == 1 and removed.isdisjoint(store.block_ids()) and removed <= {100 + i for i in range(slots)}
    store.put([300], blocks, blocks)
    store.put([301], blocks, blocks)
    added, removed = store.journal.drain()
    assert added == {300, 301} and len(removed) == 2  # each new block evicted an earlier one
    store.forget([300])
    assert store.journal.drain() == (set(), {300})


def test_the_router_weighs_what_a_replica_holds_against_its_load() -> None:
    router = create("cache_aware", {"prefill_tokens_per_s": 100, "queue_s": 0.5})
    request = RoutingRequest("r", list(range(300)))
    holds, empty = ReplicaStatus(0, cached_tokens=256), ReplicaStatus(1, cached_tokens=0)
    assert router.route("kv_shuttle", request, [holds, empty]) == 0  # 0.44 s against 3 s
    busy = ReplicaStatus(0, in_flight=6, cached_tokens=256)  # 3.44 s against 3 s: the other one
    assert router.route("kv_shuttle", request, [busy, empty]) == 1
    unknown = [ReplicaStatus(0, in_flight=2), ReplicaStatus(1, in_flight=1)]  # no store said: least loaded
    assert router.route("prefill", request, unknown) == 1
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        create("cache_aware", {"prefill_tokens_per_s": 0})


def test_the_router_counts_a_prefix_another_store_holds_as_fetched_not_recomputed() -> None:
    """With fetching, a busy holder's prefix is still worth having: the request goes to the idle
    store, which fetches it (100 tokens/s of prefill against 10,000 of fetching); without
    fetching, or where a store has stored no more than the one picked holds, nothing is fetched."""
    request = RoutingRequest("r", list(range(300)))
    busy = ReplicaStatus(0, in_flight=2, cached_tokens=256, stored_tokens=256)
    idle = ReplicaStatus(1, cached_tokens=64, stored_tokens=64)
    fetching = create("cache_aware", {"prefill_tokens_per_s": 100, "queue_s": 0.5, "fetch_tokens_per_s": 10_000})
    assert fetching.route("kv_shuttle", request, [busy, idle]) == 1  # 1.44 s against 0.46 s
    assert fetching.fetch_from("kv_shuttle", request, 1, [busy, idle]) == 0
    assert fetching.fetch_from("kv_shuttle", request, 0, [busy, idle]) is None  # it holds the most
    # blocks the holder is still computing (its last turn runs there) cannot be fetched yet: wait there
    computing = ReplicaStatus(0, in_flight=2, cached_tokens=256, stored_tokens=0)
    assert fetching.route("kv_shuttle", request, [computing, idle]) == 0  # 1.44 s against 2.36 s
    assert fetching.fetch_from("kv_shuttle", request, 1, [computing, idle]) is None
    recomputing = create("cache_aware", {"prefill_tokens_per_s": 100, "queue_s": 0.5, "fetch_tokens_per_s": 0})
    assert recomputing.route("kv_shuttle", request, [busy, idle]) == 0  # 1.44 s against 2.36 s
    assert recomputing.fetch_from("kv_shuttle", request, 1, [busy, idle]) is None
    assert create("round_robin").fetch_from("kv_shuttle", request, 1, [busy, idle]) is None


def _conversations(router, replicas: int = 2, silent: int | None = None, **options):
    """Two conversations of three turns through ``replicas`` kv-shuttle replicas routed by
    ``router``: per turn (turn, prompt tokens, cached tokens, answer), and each store's stats.
    ``silent``: a replica that does not answer the first fetch it is asked for."""
    from pdflow import LocalPipeline, Pipeline
    from pdflow.testing.server import free_port_base

    pipeline = (Pipeline.default().with_stage_config("kv_shuttle", replicas=replicas).with_router(router, **options)
                .with_ports(free_port_base()))

    async def main():
        async with LocalPipeline(pipeline) as running:
            if silent is not None:
                store = running.stage("kv_shuttle", silent)
                serve, ignored = store._serve_fetch, []

                async def once_silent(message):
                    if ignored:
                        await serve(message)
                    ignored.append(message)

                store._serve_fetch = once_silent
            client = openai_client(running.url, asynchronous=True)
            turns = []
            for first in ("Describe the sea.", "Describe a forest."):
                messages = [{"role": "user", "content": first}]
                for turn in range(3):
                    reply = await client.chat.completions.create(
                        model="smollm2", messages=messages, temperature=0, max_tokens=70,
                        extra_body={"ignore_eos": True})
                    details = reply.usage.prompt_tokens_details
                    answer = reply.choices[0].message.content
                    turns.append((turn, reply.usage.prompt_tokens, details.cached_tokens if details else 0, answer))
                    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]
                    await asyncio.sleep(0.4)  # the stores report four times a second
            return turns, [running.stage("kv_shuttle", i).stats() for i in range(replicas)]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def staying():
    return _conversations("cache_aware", fetch_tokens_per_s=0)  # never fetching


def _prefix_hit(turns) -> None:
    for turn, prompt_tokens, hit, _ in turns:
        if turn:  # the earlier turns' prompt and answer, in whole 64-token blocks
            assert hit >= (prompt_tokens - 90) // 64 * 64 and hit > 0, turns


def test_a_conversation_stays_on_the_kv_shuttle_that_holds_it(staying):
    """Two kv-shuttle replicas, two conversations of three turns: every later turn reads its
    prefix from the store (cached tokens reported), because the router sends it where the earlier
    turns' KV is (round robin would send the second turn to the other store: nothing cached).
    (Fetching is off here: the answers below are compared with these, read from their holder.)"""
    turns, stats = staying
    _prefix_hit(turns)
    assert sum(s["peer_fetches"] for s in stats) == 0


def test_a_turn_routed_away_from_its_prefix_fetches_it_from_the_store_that_holds_it(staying):
    """Every turn sent to the store that holds the least of its prefix (the router's choice, as
    when the holder is busy): the store fetches the prefix from the one that holds it instead of
    recomputing it, so every later turn still reports its prefix cached, the answers are the
    answers read from the holder (the fetched blocks are the holder's bytes), and the stores
    count the blocks they fetched and served."""
    turns, stats = _conversations(AwayRouter)
    _prefix_hit(turns)
    assert [t[3] for t in turns] == [t[3] for t in staying[0]]
    fetched = sum(s["peer_fetched_blocks"] for s in stats)
    assert fetched == sum(s["peer_served_blocks"] for s in stats) > 0
    assert sum(s["peer_fetches"] for s in stats) == 4 and sum(s["peer_fetches_failed"] for s in stats) == 0
    assert all(s["peer_fetched_blocks"] > 0 for s in stats)  # both ways: each turn goes to the other store


def test_a_store_named_to_fetch_from_that_lacks_the_prefix_or_never_answers_leaves_it_to_prefill(staying):
    """Ingress's picture is a few hundred ms old: the store it names may have evicted the
    prefix (it answers that it wrote nothing), or be gone (no answer: given up after a timeout).
    Either way the turn is computed whole, and its answer is the same."""
    turns, stats = _conversations(AwayRouter, replicas=3, silent=2, lie=True)
    assert [t[3] for t in turns] == [t[3] for t in staying[0]]
    asked, failed = sum(s["peer_fetches"] for s in stats), sum(s["peer_fetches_failed"] for s in stats)
    assert sum(s["peer_fetched_blocks"] for s in stats) == 0
    assert 1 == failed < asked  # the one not answered timed out; the others were answered "none"


def test_blocks_a_routed_request_computes_count_as_held_until_it_ends() -> None:
    """The next turn of a conversation can arrive while the last one is still queued or
    computing: its blocks are not reported yet, but they are coming to the store it was routed to."""
    held = Holdings()
    held.apply("kv_shuttle", 1, 0, True, b"", b"")
    held.expect("r-1", "kv_shuttle", 1, [5, 6, 7])
    held.expect("r-2", "kv_shuttle", 1, [5, 6])
    assert held.prefix_blocks("kv_shuttle", 1, [5, 6, 7, 8]) == 3
    held.settle("r-1")
    assert held.prefix_blocks("kv_shuttle", 1, [5, 6, 7, 8]) == 2  # r-2's are still coming
    held.expect("r-2", "kv_shuttle", 1, [9])  # routed again (migrated): only the new route counts
    assert held.prefix_blocks("kv_shuttle", 1, [5]) == 0 and held.prefix_blocks("kv_shuttle", 1, [9]) == 1
    held.settle("r-2")
    held.settle("r-2")  # twice: nothing more
    assert held.prefix_blocks("kv_shuttle", 1, [9]) == 0
