"""pdflow.kv.tiering: the memory store over a real disk tier: committed blocks go down in the
background, a prefix evicted from memory comes back up from disk with its version and its bytes,
a replaced or damaged block on disk ends the run (recompute, never served), and forgetting and
expiry reach both tiers."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdflow.kv.blocks import BlockHasher
from pdflow.kv.disk import HEADER_BYTES, DiskTier
from pdflow.kv.layout import KvLayout
from pdflow.kv.store import KvStore
from pdflow.kv.tiering import DiskBackedStore

TINY = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
BT = 4
BLOCK_BYTES = 2 * 2 * BT * 2 * 4 * 4
H = BlockHasher("m", "float32", BT)


def _kv(num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * BT, TINY.num_kv_heads, TINY.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(2)], [torch.randn(shape, generator=g) for _ in range(2)]


def _tiers(path, memory_blocks: int = 4, **store_kwargs) -> DiskBackedStore:
    store = KvStore(TINY, BT, memory_blocks * BLOCK_BYTES, high_watermark=1.0, low_watermark=1.0, **store_kwargs)
    disk = DiskTier(path, 64 * (HEADER_BYTES + BLOCK_BYTES), BLOCK_BYTES, segment_bytes=8 * (HEADER_BYTES + BLOCK_BYTES))
    return DiskBackedStore(store, disk)


async def _on_disk_only(tiers: DiskBackedStore, blocks: int, seed: int) -> list[int]:
    """A chat of ``blocks`` blocks written to disk and forgotten in memory: its block ids."""
    chat = H.ids(list(range(blocks * BT)))
    tiers.store.put(chat, *_kv(blocks, seed=seed))
    await tiers.drain()
    tiers.store.forget()
    return chat


def test_a_prefix_evicted_from_memory_comes_back_from_disk_as_it_was(tmp_path):
    async def main():
        tiers = _tiers(tmp_path)
        store = tiers.store
        chat = H.ids(list(range(3 * BT)))
        keys, values = _kv(3, seed=1)
        store.put(chat, keys, values)
        versions = store.versions(chat)
        await tiers.drain()
        assert tiers.stats().spilled_blocks == 3 and all(block_id in tiers.disk for block_id in chat)
        for i in range(4):  # other work pushes the chat out of memory
            store.put(H.ids(list(range(100 * (i + 1), 100 * (i + 1) + BT))), *_kv(1, seed=10 + i))
        await tiers.drain()
        assert store.lookup(chat) == 0
        assert await tiers.load("r1", chat) == 3
        assert store.versions(chat) == versions  # the same versions, not new ones
        got_keys, got_values = store.get(chat)
        for layer in range(2):
            assert torch.equal(got_keys[layer], keys[layer]) and torch.equal(got_values[layer], values[layer])
        assert await tiers.load("r2", chat) == 0  # in memory now: nothing to read
        stats = tiers.stats()
        assert (stats.disk_loads, stats.disk_loaded_blocks, stats.disk_load_failed) == (1, 3, 0)
        await tiers.drain()
        assert tiers.disk.stats().writes == 3 + 4  # what came back up is not written again
        tiers.disk.close()
    asyncio.run(main())


def test_a_restart_finds_what_was_committed(tmp_path):
    async def main():
        tiers = _tiers(tmp_path)
        chat = H.ids(list(range(2 * BT)))
        tiers.store.put(chat, *_kv(2, seed=2))
        await tiers.drain()
        tiers.disk.close()
        again = _tiers(tmp_path, first_version=tiers.disk.max_version + 1)  # a new process, memory empty
        assert again.store.lookup(chat) == 0 and await again.load("r", chat) == 2
        assert torch.equal(again.store.get(chat)[1][1], _kv(2, seed=2)[1][1])
        again.disk.close()
    asyncio.run(main())


def test_a_replaced_or_damaged_block_on_disk_ends_the_run_and_is_never_served(tmp_path):
    async def main():
        tiers = _tiers(tmp_path, memory_blocks=8)
        store, disk = tiers.store, tiers.disk
        chat = await _on_disk_only(tiers, 4, seed=3)
        seen = tiers.on_disk(chat, 0)  # a reader looks, then the block is replaced before it reads
        assert len(seen) == 4
        disk.put(chat[2], chat[1], bytes(BLOCK_BYTES), version=seen[2] + 100)
        versions = tiers.on_disk(chat, 0)
        assert versions[2] == seen[2] + 100
        # a bit flipped in block 1's bytes on disk
        record = disk._index[chat[1]]
        with open(disk._file(record.segment), "r+b") as f:
            f.seek(record.offset + 7)
            byte = f.read(1)[0]
            f.seek(record.offset + 7)
            f.write(bytes([byte ^ 1]))
        assert await tiers.load("r", chat) == 1  # block 0 only: block 1 is caught
        assert tiers.stats().disk_load_failed == 1 and chat[1] not in disk and disk.stats().corrupted == 1
        assert store.lookup(chat) == 1
        disk.close()
    asyncio.run(main())


def test_forget_and_expiry_reach_both_tiers(tmp_path):
    async def main():
        tiers = _tiers(tmp_path, memory_blocks=8)
        store, disk = tiers.store, tiers.disk
        chat, other = H.ids(list(range(3 * BT))), H.ids(list(range(700, 700 + 2 * BT)))
        store.put(chat, *_kv(3, seed=4))
        store.put(other, *_kv(2, seed=5))
        store.put(H.ids(list(range(900, 900 + BT))), *_kv(1, seed=6), keep_s=0.2)
        await tiers.drain()
        assert disk.stats().blocks == 6
        assert await tiers.forget(chat[1:2]) == (2, 2)  # the block and its child, in both tiers
        assert disk.stats().blocks == 4 and chat[0] in disk and chat[2] not in disk
        time.sleep(0.25)
        store.expire()
        assert disk.expire() == 1 and store.stats().expired == 1
        assert await tiers.forget() == (3, 3) and disk.stats().blocks == 0
        disk.close()
    asyncio.run(main())


def test_the_writer_runs_in_the_background_and_memory_evicting_first_is_counted(tmp_path):
    async def main():
        tiers = _tiers(tmp_path, memory_blocks=2)
        writer = asyncio.ensure_future(tiers.run())
        try:
            for i in range(3):  # three blocks into two slots: the first is evicted before the writer ran
                tiers.store.put(H.ids(list(range(50 * i, 50 * i + BT))), *_kv(1, seed=i))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not tiers.stats().spill_queued:
                    break
            stats = tiers.stats()
            assert stats.spill_missed == 1 and stats.spilled_blocks == 2 and stats.spill_s > 0
        finally:
            writer.cancel()
            tiers.disk.close()
    asyncio.run(main())


def test_blocks_of_another_size_are_refused(tmp_path):
    store = KvStore(TINY, BT, 4 * BLOCK_BYTES)
    disk = DiskTier(tmp_path, 64 * BLOCK_BYTES, BLOCK_BYTES // 2, segment_bytes=8 * BLOCK_BYTES)
    with pytest.raises(ValueError, match="bytes, the store's"):
        DiskBackedStore(store, disk)
    disk.close()


def test_a_load_cancelled_mid_read_frees_its_slots_only_after_the_read(tmp_path):
    async def main():
        tiers = _tiers(tmp_path, memory_blocks=8)
        store, disk = tiers.store, tiers.disk
        chat = await _on_disk_only(tiers, 3, seed=7)
        slow_read, reading = disk.get_many, []

        def get_many(*args, **kwargs):
            reading.append(True)
            time.sleep(0.3)  # a slow disk
            return slow_read(*args, **kwargs)

        disk.get_many = get_many
        load = asyncio.ensure_future(tiers.load("r", chat))
        while not reading:
            await asyncio.sleep(0.01)
        load.cancel()
        began = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert time.monotonic() - began > 0.2  # it waited for the read before letting the slots go
        assert store.stats().leases == 0 and store.stats().blocks_used == 0 and store.lookup(chat) == 0
        disk.close()
    asyncio.run(main())
