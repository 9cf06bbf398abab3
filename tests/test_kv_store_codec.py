"""The store's memory tier with a codec: its arena holds each block encoded (int8: 3.9x the
blocks in the same bytes), chunks go into it encoded and come out of it encoded, the plain API
encodes and decodes, block ids change with the codec, and the disk tier keeps the encodings."""

from __future__ import annotations

import pytest
import torch

from pdflow.kv.arena import ArenaLayout
from pdflow.kv.blocks import BlockHasher
from pdflow.kv.codecs import codec
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.kv.outcomes import Corrupted
from pdflow.kv.store import KvStore

SMOL = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64)
LAYOUT = KvLayout(num_layers=2, num_kv_heads=3, head_dim=64)
BT = 16


def _kv(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(2)], [torch.randn(shape, generator=g) for _ in range(2)]


def _through(c, x, kind):
    back = torch.empty_like(x)
    c.decode_run(c.encode_run(x.contiguous(), kind, BT), kind, back, BT)
    return back


def test_the_same_memory_holds_3_9x_the_blocks_in_int8_and_7x_in_int4():
    raw = ArenaLayout.for_capacity(SMOL, 64, 1 << 30)
    for name, at_least in (("int8", 3.9), ("int4", 7.0)):
        encoded = ArenaLayout.for_capacity(SMOL, 64, 1 << 30, codec(name))
        assert encoded.num_slots >= at_least * raw.num_slots and encoded.nbytes <= 1 << 30
        # keys and values of every layer tile the memory, slot after slot, with no gap or overlap
        end = 0
        for start, size in sorted((encoded.offset(layer, kind, slot), encoded.span(kind)) for layer in
                                  range(SMOL.num_layers) for kind in (KEYS, VALUES) for slot in range(encoded.num_slots)):
            assert start == end
            end += size
        assert end == encoded.nbytes
        assert encoded.offset(4, VALUES, 7) == encoded.offset(4, VALUES, 6) + encoded.span(VALUES)
    with pytest.raises(ValueError, match="no tensor view"):
        encoded.view(torch.zeros(encoded.nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_put_and_get_go_through_the_codec(name):
    c = codec(name)
    store = KvStore(LAYOUT, BT, 64 * 1024, codec=c)
    plain = KvStore(LAYOUT, BT, 64 * 1024)
    assert store.layout.num_slots > 3.5 * plain.layout.num_slots and store.blocks is None
    ids = BlockHasher("m", "float32", BT, c.spec).ids(list(range(3 * BT)))
    keys, values = _kv(3 * BT, seed=2)
    assert store.put(ids, keys, values) == 3 and store.lookup(ids) == 3
    got_keys, got_values = store.get(ids)
    for layer in range(2):
        for kind, got, x in ((KEYS, got_keys, keys), (VALUES, got_values, values)):
            want = torch.cat([_through(c, x[layer][i * BT:(i + 1) * BT], kind) for i in range(3)])
            assert torch.equal(got[layer], want)
    # checksums cover the encodings: a flipped byte in a block's encoding is caught
    store.memory[store.layout.offset(1, VALUES, 0) + 5] ^= 1
    with pytest.raises(Corrupted):
        store.get(ids)
    assert store.stats().checksum_failures == 1 and store.lookup(ids) == 0


def test_block_ids_name_the_codec():
    plain = BlockHasher("m", "float32", BT).ids(list(range(BT)))
    assert BlockHasher("m", "float32", BT, "none").ids(list(range(BT))) == plain  # as before codecs
    assert BlockHasher("m", "float32", BT, "int8").ids(list(range(BT))) != plain
    assert BlockHasher("m", "float32", BT, "int8").ids(list(range(BT))) != BlockHasher("m", "float32", BT, "int4").ids(list(range(BT)))


def test_chunks_go_into_the_arena_encoded_and_out_of_it_as_they_are_held():
    """into_slots encodes what prefill (or decode) writes into an encoded store; from_slots and
    between_slots send the encodings the slots hold, with headers that say so; decoded where they
    land, they give the KV after one trip through the codec."""
    from pdflow.kv.chunks import between_slots, from_slots, into_slots, slot_of
    from pdflow.kv.coded import decode_in_place

    c = codec("int8")
    store = ArenaLayout(LAYOUT, BT, 8, c)
    memory = torch.zeros(store.nbytes, dtype=torch.uint8)
    keys, values = _kv(2 * BT + 5, seed=3)  # two blocks and a partial third
    slots = [2, 3, 6]
    chunks = list(into_slots("r", store, 1, 1, keys[1], values[1], slots, 0))
    assert [(h.kind, h.token_start, h.token_end, h.codec) for h, _ in chunks] == [
        (KEYS, 0, 32, "int8"), (KEYS, 32, 37, "int8"), (VALUES, 0, 32, "int8"), (VALUES, 32, 37, "int8")]
    for header, data in chunks:
        assert header.nbytes == store.run_bytes(header.kind, header.token_end - header.token_start) == data.nbytes
        assert slot_of(store, header) == slots[header.token_start // BT]
        memory[header.offset: header.offset + header.nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    # out to a request buffer (prefill's cached prefix): the two full blocks
    out = torch.zeros(LAYOUT.request_bytes(2 * BT), dtype=torch.uint8)
    for header, data in from_slots("r", store, memory.numpy().data.cast("B"), 1, slots[:2], 2 * BT, 2 * BT, 9):
        assert header.codec == "int8" and header.region == 9
        out[header.offset: header.offset + header.nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        decode_in_place(header, out.numpy().data.cast("B"))
    got_keys, got_values = LAYOUT.views(out, 2 * BT, 1)
    assert torch.equal(got_keys.transpose(0, 1), _through(c, keys[1][:2 * BT], KEYS))
    assert torch.equal(got_values.transpose(0, 1), _through(c, values[1][:2 * BT], VALUES))
    # out to decode's pool blocks (raw), the partial block included
    pool = ArenaLayout(LAYOUT, BT, 4)
    target = torch.zeros(pool.nbytes, dtype=torch.uint8)
    parts = list(between_slots("r", store, memory.numpy().data.cast("B"), 1, (KEYS, VALUES), slots, 0, 37, pool,
                               [1, 2, 0], 4))
    for header, data in parts:
        target[header.offset: header.offset + header.nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        decode_in_place(header, target.numpy().data.cast("B"))
    blocks = pool.view(target)
    assert torch.equal(blocks[1, KEYS, 0, :5], _through(c, keys[1][32:37], KEYS))
    assert torch.equal(blocks[1, VALUES, 2], _through(c, values[1][16:32], VALUES))
    with pytest.raises(ValueError, match="own bytes"):
        list(between_slots("r", pool, target.numpy().data.cast("B"), 1, (KEYS,), [0], 0, 4, store, [0], 4))
    # into another store's arena (a prefix fetched from a peer): whole blocks, as their encodings
    peer = torch.zeros(store.nbytes, dtype=torch.uint8)
    for header, data in between_slots("r", store, memory.numpy().data.cast("B"), 1, (KEYS, VALUES), slots[:2], 0,
                                      2 * BT, store, [5, 0], 0):
        assert header.codec == "int8" and header.nbytes == data.nbytes
        peer[header.offset: header.offset + header.nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for kind in (KEYS, VALUES):
        for src, dst in ((2, 5), (3, 0)):
            at, to, n = store.offset(1, kind, src), store.offset(1, kind, dst), store.span(kind)
            assert torch.equal(peer[to: to + n], memory[at: at + n])
    with pytest.raises(ValueError, match="whole blocks"):  # a partial block has no encoding of its own
        list(between_slots("r", store, memory.numpy().data.cast("B"), 1, (KEYS,), slots, 0, 37, store, [5, 0, 1], 0))


def test_the_disk_tier_keeps_the_encodings(tmp_path):
    """Blocks written behind to disk are the encodings (a fraction of fp32's bytes), and a prefix
    read back from disk decodes to what it was."""
    import asyncio

    from pdflow.kv.disk import DiskTier
    from pdflow.kv.tiering import DiskBackedStore

    c = codec("int4")

    async def main():
        store = KvStore(LAYOUT, BT, 32 * 1024, codec=c)
        disk = DiskTier(tmp_path, capacity_bytes=1 << 20, block_bytes=store.layout.block_bytes, segment_bytes=256 << 10)
        tiers = DiskBackedStore(store, disk)
        ids = BlockHasher("m", "float32", BT, c.spec).ids(list(range(2 * BT)))
        store.put(ids, *_kv(2 * BT, seed=4))
        before = store.get(ids)
        await tiers.drain()
        store.forget()
        assert store.lookup(ids) == 0 and all(block_id in disk for block_id in ids)
        assert await tiers.load("r", ids) == 2
        after = store.get(ids)
        for a, b in zip(before[0] + before[1], after[0] + after[1]):
            assert torch.equal(a, b)
        disk.close()

    # a sixth of fp32's bytes (16-token blocks: a key scale and minimum per channel weigh more than at 64)
    assert KvStore(LAYOUT, BT, 32 * 1024, codec=c).layout.block_bytes * 6 <= LAYOUT.request_bytes(BT)
    asyncio.run(main())
