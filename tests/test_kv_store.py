"""pdflow.kv: block ids, the arena's geometry, and the store (prefix lookup, leases, LRU, checksums)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdflow.kv.arena import ArenaLayout, Run, runs
from pdflow.kv.blocks import BlockHasher
from pdflow.transports.checksum import checksum
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.outcomes import Corrupted, Miss, Outcome, VersionMismatch
from pdflow.kv.store import KvStore, StoreFull

TINY = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
BT = 4
BLOCK_BYTES = 2 * 2 * BT * 2 * 4 * 4  # layers * kinds * tokens * heads * dim * 4 bytes


def _store(blocks: int, **kwargs) -> KvStore:
    return KvStore(TINY, BT, blocks * BLOCK_BYTES, **kwargs)


def _kv(num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * BT, TINY.num_kv_heads, TINY.head_dim)
    return ([torch.randn(shape, generator=g) for _ in range(2)], [torch.randn(shape, generator=g) for _ in range(2)])


# --- block ids ------------------------------------------------------------------------------


def test_block_ids_are_chained_and_salted() -> None:
    hasher = BlockHasher("smollm2", "float32", 4)
    ids = hasher.ids(list(range(10)))
    assert len(ids) == 2  # the partial third block gets no id
    assert len(set(ids)) == 2
    other = hasher.ids([99] + list(range(1, 10)))
    assert other[0] != ids[0] and other[1] != ids[1], "a change in block 0 must change every later id"
    same_tail = hasher.ids(list(range(4)) + [4, 5, 6, 7])
    assert same_tail == ids
    assert BlockHasher("smollm2", "bfloat16", 4).ids(list(range(8))) != ids
    assert BlockHasher("other-model", "float32", 4).ids(list(range(8))) != ids
    assert hasher.ids(list(range(12)), start=1) == hasher.ids(list(range(12)))[1:]
    assert hasher.ids(list(range(12)), start=2, parent=ids[1]) == hasher.ids(list(range(12)))[2:]


def test_block_ids_are_the_same_in_another_process() -> None:
    code = ("from pdflow.kv.blocks import BlockHasher; "
            "print(BlockHasher('smollm2', 'float32', 16).ids(list(range(100))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == str(BlockHasher("smollm2", "float32", 16).ids(list(range(100))))


# --- the arena ------------------------------------------------------------------------------


def test_arena_offsets_tile_the_memory_and_runs_are_contiguous() -> None:
    arena = ArenaLayout(TINY, BT, num_slots=5)
    assert arena.nbytes == 5 * BLOCK_BYTES
    spans = sorted((arena.offset(layer, kind, slot), arena.slot_span)
                   for layer in range(2) for kind in (KEYS, VALUES) for slot in range(5))
    end = 0
    for start, size in spans:
        assert start == end
        end += size
    assert end == arena.nbytes
    # the keys of layer 1 over slots 2..3 are one span: slot 3 starts where slot 2 ends
    assert arena.offset(1, KEYS, 3) == arena.offset(1, KEYS, 2) + arena.slot_span
    assert arena.offset(1, KEYS, 2, token=3) == arena.offset(1, KEYS, 2) + 3 * TINY.token_bytes
    assert list(runs([4, 5, 6, 9, 1], 8, 8 + 4 * BT + 2, BT)) == [
        Run(4, 3, 8, 20), Run(9, 1, 20, 24), Run(1, 1, 24, 26)]  # the last block is partial
    assert list(runs([7, 8], 0, 3, BT)) == [Run(7, 2, 0, 3)]


def test_chunks_between_two_arenas_put_every_token_in_its_slot() -> None:
    """A request's tokens 4..18 (blocks 1..4) from store slots [3, 4, 5, 0] to decode slots
    (block j of the request in ``dst_slots[j]``): one chunk per run of blocks consecutive on both
    sides, and read back through the destination's table every token is where it belongs."""
    from pdflow.kv.chunks import between_slots, slot_of

    src, dst = ArenaLayout(TINY, BT, 6), ArenaLayout(TINY, BT, 9)
    memory = torch.randn(src.nbytes // 4).view(torch.uint8).numpy().data.cast("B")
    src_view = src.view(torch.frombuffer(memory, dtype=torch.uint8))
    src_slots, dst_slots = [3, 4, 5, 0], [8, 1, 2, 6, 7]
    target = torch.zeros(dst.nbytes, dtype=torch.uint8)
    chunks = list(between_slots("r", src, memory, 1, (KEYS, VALUES), src_slots, 4, 18, dst, dst_slots, 5))
    # blocks 1-2 consecutive on both sides (3,4 -> 1,2); block 3 (5 -> 6); block 4 (0 -> 7), 2 tokens
    assert [(h.kind, h.token_start, h.token_end) for h, _ in chunks] == [
        (KEYS, 4, 12), (VALUES, 4, 12), (KEYS, 12, 16), (VALUES, 12, 16), (KEYS, 16, 18), (VALUES, 16, 18)]
    for header, data in chunks:
        tokens = header.token_end - header.token_start
        assert header.region == 5 and header.nbytes == len(data) == tokens * TINY.token_bytes
        target[header.offset : header.offset + header.nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert slot_of(dst, header) == dst_slots[header.token_start // BT]
    dst_view = dst.view(target)
    for token in range(4, 18):
        block, row = divmod(token, BT)
        for kind in (KEYS, VALUES):
            assert torch.equal(dst_view[1, kind, dst_slots[block], row], src_view[1, kind, src_slots[block - 1], row])
    with pytest.raises(ValueError, match="do not fit"):
        list(between_slots("r", src, memory, 1, (KEYS,), src_slots, 4, 18, dst, dst_slots[:4], 5))


# --- the store ------------------------------------------------------------------------------


def test_put_lookup_get_round_trip() -> None:
    store = _store(8)
    ids = BlockHasher("m", "float32", BT).ids(list(range(5 * BT)))
    keys, values = _kv(3, seed=1)
    assert store.lookup(ids) == 0
    assert store.put(ids[:3], keys, values) == 3
    assert store.put(ids[:3], keys, values) == 0  # already stored: kept, not rewritten
    assert store.lookup(ids) == 3
    got_keys, got_values = store.get(ids[:3])
    for layer in range(2):
        assert torch.equal(got_keys[layer], keys[layer]) and torch.equal(got_values[layer], values[layer])
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.misses, stats.hit_blocks, stats.hit_tokens) == (2, 1, 1, 3, 3 * BT)
    assert stats.blocks_cached == stats.blocks_used == 3 and stats.leases == 0 and stats.leased_blocks == 0


def test_a_lease_pins_its_prefix_and_commits_what_it_wrote() -> None:
    store = _store(8)
    ids = BlockHasher("m", "float32", BT).ids(list(range(4 * BT)))
    keys, values = _kv(2, seed=2)
    store.put(ids[:2], keys, values)
    lease = store.lease("r1", ids, extra_slots=1)
    assert lease.hit == 2 and len(lease.slots) == 5 and len(lease.new_slots) == 3
    assert store.stats().leased_blocks == 2 and store.stats().leases == 1
    new_keys, new_values = _kv(2, seed=3)
    store.write(lease.new_slots[:2], 2 * BT, new_keys, new_values)
    assert store.commit(lease, 2) and store.commit(lease, 3)
    assert not store.commit(lease, 3)  # already stored
    assert store.stats().leased_blocks == 4
    assert store.release("r1") and not store.release("r1")
    stats = store.stats()
    assert stats.leased_blocks == 0 and stats.leases == 0 and stats.blocks_used == 4  # the extra slot is free
    keys_all, _ = store.get(ids)
    assert torch.equal(keys_all[1][2 * BT :], new_keys[1])


def test_nothing_leased_is_evicted_and_a_full_store_says_so() -> None:
    store = _store(4)
    h = BlockHasher("m", "float32", BT)
    a = h.ids(list(range(3 * BT)))
    store.lease("writer", a)  # 3 slots being written
    with pytest.raises(StoreFull, match="leased"):
        store.lease("other", h.ids(list(range(100, 100 + 2 * BT))))
    assert store.get_lease("other") is None and store.stats().leased_blocks == 0
    with pytest.raises(StoreFull, match="exceed the whole store"):
        store.lease("huge", h.ids(list(range(5 * BT))))
    store.release("writer")
    assert store.lease("other", h.ids(list(range(100, 100 + 2 * BT)))).hit == 0


def test_lru_evicts_children_before_parents_and_the_least_recent_first() -> None:
    store = _store(4, high_watermark=1.0, low_watermark=1.0)
    h = BlockHasher("m", "float32", BT)
    chain = h.ids(list(range(2 * BT)))  # parent, child
    other = h.ids(list(range(500, 500 + 2 * BT)))
    store.put(chain, *_kv(2, 1))
    store.put(other, *_kv(2, 2))
    store.lookup(chain)  # chain is now the most recent; other's parent is the least recent block
    store.put(h.ids(list(range(900, 900 + BT))), *_kv(1, 3))  # one slot: other's child goes, not its parent
    assert other[0] in store and other[1] not in store and all(i in store for i in chain)
    store.put(h.ids(list(range(901, 901 + BT))), *_kv(1, 4))  # now other's parent is a leaf, the oldest
    assert other[0] not in store and all(i in store for i in chain)
    assert store.stats().evictions == 2


def test_watermarks_evict_down_to_the_low_mark() -> None:
    store = _store(10, high_watermark=0.8, low_watermark=0.5)
    h = BlockHasher("m", "float32", BT)
    for i in range(8):
        store.put(h.ids(list(range(i * 1000, i * 1000 + BT))), *_kv(1, i))
    assert store.stats().blocks_used == 8
    store.put(h.ids(list(range(99000, 99000 + BT))), *_kv(1, 99))  # 9 > 8: down to 5
    assert store.stats().blocks_used == 5 and store.stats().evictions == 4


def test_a_lease_of_a_dead_holder_expires() -> None:
    now = [0.0]
    store = _store(4, lease_ttl_s=10, clock=lambda: now[0])
    h = BlockHasher("m", "float32", BT)
    store.lease("dead", h.ids(list(range(4 * BT))))
    now[0] = 5
    store.renew("dead")
    now[0] = 14
    assert store.expire() == []
    now[0] = 15
    assert store.expire() == ["dead"]
    assert store.stats().blocks_used == 0 and store.stats().leases == 0


def test_a_lease_grows_and_commits_what_its_holder_wrote_past_its_ids() -> None:
    """decode attending in the store: the request's lease takes slots for the answer too, and the
    answer's blocks are committed where decode wrote them."""
    store = _store(8)
    h = BlockHasher("m", "float32", BT)
    tokens = list(range(4 * BT))
    ids = h.ids(tokens)
    lease = store.lease("r", ids[:1], extra_slots=1)  # a prompt of 1.5 blocks
    assert store.grow_lease("r", 2) == lease.slots[2:] and len(lease.slots) == 4
    keys, values = _kv(4, seed=5)
    store.write(lease.slots, 0, keys, values)
    assert store.commit(lease, 0)
    with pytest.raises(ValueError, match="do not extend"):
        store.grow_lease("r", ids=h.ids(list(range(100, 100 + 2 * BT))))
    store.grow_lease("r", ids=ids[:3])
    assert store.commit(lease, 1) and store.commit(lease, 2)
    store.release("r")
    assert store.stats().blocks_used == 3 and store.lookup(ids) == 3
    assert torch.equal(store.get(ids[:3])[1][0], values[0][: 3 * BT])
    store.lease("s", [], extra_slots=4)
    with pytest.raises(StoreFull):
        store.grow_lease("s", 5)  # 1 free and 3 to evict
    assert len(store.get_lease("s").slots) == 4  # a lease that could not grow keeps what it had


def test_slots_released_in_quarantine_come_back_only_after_it() -> None:
    now = [0.0]
    store = _store(4, clock=lambda: now[0])
    store.lease("gone", [], extra_slots=3)
    store.release("gone", quarantine_s=2.0)
    stats = store.stats()
    assert stats.leases == 0 and stats.blocks_quarantined == 3 and stats.blocks_used == 3
    with pytest.raises(StoreFull):
        store.lease("next", [], extra_slots=2)
    now[0] = 2.0
    assert len(store.lease("next", [], extra_slots=4).slots) == 4
    assert store.stats().blocks_quarantined == 0


def test_a_corrupt_block_is_dropped_with_its_children_and_counted() -> None:
    store = _store(8)
    h = BlockHasher("m", "float32", BT)
    ids = h.ids(list(range(4 * BT)))
    store.put(ids[:3], *_kv(3, 5))
    lease = store.lease("reader", ids[:1])  # pins block 0 while block 1 goes bad
    slot = store._index[ids[1]].slot
    store.blocks[1, VALUES, slot, 2, 0, 1] += 1.0  # one float of layer 1's values
    assert store.lookup(ids) == 3  # lookup does not read the bytes
    second = store.lease("r2", ids)
    assert second.hit == 1, "the hit must end before the corrupt block"
    stats = store.stats()
    assert stats.checksum_failures == 1
    assert ids[1] not in store and ids[2] not in store and ids[0] in store
    store.release("reader")
    store.release("r2")
    assert store.stats().blocks_used == 1 and store.stats().leased_blocks == 0
    assert lease.hit == 1


def test_a_commit_keeps_the_span_checksums_taken_as_the_spans_landed() -> None:
    """kv-shuttle checksums each span as its chunk lands and commits the block with them: a later
    lease verifies against those, so checksums of other bytes would drop the block."""
    store = _store(8)
    ids = BlockHasher("m", "float32", BT).ids(list(range(2 * BT)))
    lease = store.lease("r", ids)
    store.write(lease.slots, 0, *_kv(2, seed=7))
    taken = [store.span_checksum(lease.slots[0], layer, kind) for layer in range(2) for kind in (KEYS, VALUES)]
    assert taken == [checksum(span) for span in store.slot_spans(lease.slots[0])]  # the order commit keeps
    assert store.commit(lease, 0, checksums=taken)
    with pytest.raises(ValueError, match="4 spans, got 3"):
        store.commit(lease, 1, checksums=taken[:3])
    wrong = [store.span_checksum(lease.slots[1], *divmod(i, 2)) for i in range(4)]
    wrong[3] ^= 1  # as if layer 1's values had been checksummed while other bytes were there
    assert store.commit(lease, 1, checksums=wrong)
    store.release("r")
    assert store.lease("reader", ids).hit == 1 and store.stats().checksum_failures == 1


def test_a_corrupt_block_still_leased_is_freed_at_its_last_release() -> None:
    store = _store(4)
    ids = BlockHasher("m", "float32", BT).ids(list(range(2 * BT)))
    store.put(ids, *_kv(2, 6))
    store.lease("holder", ids)  # pins both
    store.blocks[0, KEYS, store._index[ids[1]].slot] += 1.0
    assert store.lease("reader", ids).hit == 1
    assert ids[1] not in store
    assert store.stats().blocks_used == 3  # block 0, the detached block 1, the reader's slot for block 1
    store.release("holder")
    store.release("reader")
    assert store.stats().blocks_used == 1  # block 0 stays cached; the detached slot is free


# --- versions, expiry, forgetting -----------------------------------------------------------


def test_a_re_put_is_a_new_version_and_a_reader_of_the_old_one_is_told() -> None:
    store = _store(8)
    ids = BlockHasher("m", "float32", BT).ids(list(range(3 * BT)))
    old, new = _kv(3, seed=1), _kv(3, seed=2)
    store.put(ids, *old)
    recorded = store.versions(ids)
    assert len(recorded) == 3 and recorded == sorted(set(recorded))
    reader = store.lease("reader", ids[:2], write=False)  # holds version v of blocks 0 and 1
    slots_then = list(reader.slots)
    assert store.put(ids[1:2], *[[t[BT : 2 * BT] for t in kv] for kv in new], replace=True) == 1
    assert store.versions(ids)[1] > recorded[1] and store.versions(ids)[0] == recorded[0]
    with pytest.raises(VersionMismatch) as caught:
        store.get(ids[:2], versions=recorded[:2])
    assert caught.value.outcome is Outcome.VERSION_MISMATCH and caught.value.block_id == ids[1]
    held = store.read(slots_then, 2 * BT)  # the leased old bytes are still there for the reader
    assert torch.equal(held[0][0][BT:], old[0][0][BT : 2 * BT])
    got = store.get(ids, versions=store.versions(ids))  # the new version, and its child still hangs from it
    assert torch.equal(got[0][0][BT : 2 * BT], new[0][0][BT : 2 * BT]) and store.lookup(ids) == 3
    store.release("reader")
    assert store.stats().blocks_used == 3  # the old version's slot came back at its last release
    with pytest.raises(Miss):
        store.get([12345])


def test_a_corrupt_block_is_a_typed_outcome_of_get() -> None:
    store = _store(4)
    ids = BlockHasher("m", "float32", BT).ids(list(range(2 * BT)))
    store.put(ids, *_kv(2, seed=1))
    slot = store.block_info(ids[1])[0]
    store.blocks[1, 1, slot, 0, 0, 0] += 1.0
    with pytest.raises(Corrupted):
        store.get(ids)
    assert ids[1] not in store and store.stats().checksum_failures == 1


def test_expired_blocks_are_never_found_and_their_slots_come_back() -> None:
    now = [0.0]
    store = _store(8, block_ttl_s=10, clock=lambda: now[0])
    h = BlockHasher("m", "float32", BT)
    forever, mortal, private = h.ids(list(range(2 * BT))), h.ids(list(range(50, 50 + 2 * BT))), h.ids([7] * BT)
    store.put(forever, *_kv(2, 1), keep_s=float("inf"))
    store.put(mortal, *_kv(2, 2))  # the store's 10 s
    assert store.put(private, *_kv(1, 3), keep_s=0) == 0  # a caller whose data must not be kept
    assert store.stats().blocks_used == 4 and private[0] not in store
    reader = store.lease("reader", mortal, write=False)
    now[0] = 10
    assert mortal[0] not in store and store.lookup(mortal) == 0  # never served once expired
    store.expire()
    assert store.stats().expired == 2 and store.lookup(forever) == 2
    assert store.stats().blocks_used == 4  # leased by the reader: its slots wait for it
    assert torch.equal(store.read(reader.slots, 2 * BT)[0][0], _kv(2, 2)[0][0])
    store.release("reader")
    assert store.stats().blocks_used == 2


def test_forget_drops_a_prefix_with_everything_built_on_it_or_all() -> None:
    store = _store(16)
    h = BlockHasher("m", "float32", BT)
    chat = list(range(4 * BT))
    store.put(h.ids(chat), *_kv(4, 1))
    store.put(h.ids(chat[: 2 * BT] + [999] * 2 * BT), *_kv(4, 2))  # shares chat's first two blocks
    other = h.ids(list(range(500, 500 + 2 * BT)))
    store.put(other, *_kv(2, 3))
    assert store.forget(h.ids(chat)[2:3]) == 2  # chat's third block and its child; the branch stays
    assert store.lookup(h.ids(chat)) == 2 and store.lookup(h.ids(chat[: 2 * BT] + [999] * 2 * BT)) == 4
    assert store.forget(h.ids(chat)[:1]) == 4  # the first block takes both branches
    assert store.lookup(other) == 2 and store.stats().forgotten == 6
    assert store.forget() == 2 and store.stats().blocks_used == 0 and store.forget([1, 2]) == 0


def test_health_counts_the_leases_by_their_holder() -> None:
    """kv-shuttle's /health says what pins memory: each holder kind of lease the stage takes."""
    from pdflow.stages.kv_shuttle import lease_kinds

    store = _store(4)
    ids = [1, 2]
    for owner in (LeaseOwner("req-1"), LeaseOwner("req-1", LeaseKind.ANSWER), LeaseOwner("req-2", LeaseKind.FETCH),
                  LeaseOwner("req-3", LeaseKind.LOAD), LeaseOwner("req-4:fetch", LeaseKind.SERVE),
                  LeaseOwner("put:1", LeaseKind.WRITE)):
        store.lease(owner, ids, write=False)
    assert lease_kinds(store.lease_owners()) == {"leases_requests": 1, "leases_answers": 1, "leases_fetching": 1,
                                                 "leases_loading": 1, "leases_serving": 1}
    store.release(LeaseOwner("req-1", LeaseKind.ANSWER))
    assert lease_kinds(store.lease_owners())["leases_answers"] == 0 and store.get_lease(LeaseOwner("req-1")) is not None


def test_a_lease_owner_is_a_value_not_a_position() -> None:
    """Owners equal by request and kind name one lease; the same request's other kinds are others."""
    store = _store(4)
    store.lease(LeaseOwner("r"), [1], write=False)
    with pytest.raises(ValueError):
        store.lease(LeaseOwner("r", LeaseKind.REQUEST), [1], write=False)
    store.lease(LeaseOwner("r", LeaseKind.ANSWER), [1], write=False)
    assert store.release(LeaseOwner("r")) and store.lease_owners() == [LeaseOwner("r", LeaseKind.ANSWER)]
