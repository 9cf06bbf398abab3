"""Memory kinds on the data plane, and staging device bytes through a bounded pool of host buffers.

The CUDA copies themselves run only where a GPU is (scripts/device_check.sh); what runs here is
the pool's bound, the path each link takes, the refusals, and that copies leave the event loop.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdflow import transports
from pdflow.transports.memory import DEVICE, HOST, HOST_ONLY, MemoryKinds, kind_of, memory_of
from pdflow.transports.staging import Stager, StagingPool, data_path


def test_memory_of_names_where_the_bytes_are() -> None:
    assert memory_of(b"x") == memory_of(bytearray(2)) == memory_of(torch.zeros(2)) == HOST
    assert memory_of(torch.empty(2, device="meta")) == "meta"
    assert kind_of("host") == kind_of("cpu") == HOST and kind_of("cuda:1") == kind_of("meta") == DEVICE


def test_memory_kinds_pairs_and_description() -> None:
    assert HOST_ONLY.pairs() == [(HOST, HOST)]
    both = MemoryKinds(frozenset({HOST, DEVICE}), frozenset({DEVICE}))
    assert both.pairs() == [(HOST, DEVICE), (DEVICE, DEVICE)]
    assert both.describe() == "sends from host or device memory, lands in device memory"


def test_data_path_is_direct_only_where_the_transport_moves_that_memory() -> None:
    assert data_path("host", HOST_ONLY, "send", "tcp").description == "direct: tcp sends from host memory"
    assert data_path("host", HOST_ONLY, "receive", "tcp").description == "direct: tcp receives into host memory"
    staged = data_path("cuda:0", HOST_ONLY, "send", "tcp")
    assert not staged.direct and staged.description.startswith("staged: copied to host through a bounded pool")
    assert staged.description.endswith("then sent by tcp")
    landed = data_path("cuda:0", HOST_ONLY, "receive", "shm")
    assert not landed.direct and landed.description.endswith(
        "landed in host memory by shm, then copied to cuda:0 off the event loop")
    device = MemoryKinds(frozenset({HOST, DEVICE}), frozenset({DEVICE}))
    assert data_path("cuda:0", device, "send").direct and data_path("cuda:0", device, "receive").direct
    assert not data_path("host", device, "receive").direct
    with pytest.raises(ValueError, match="direction"):
        data_path("host", device, "sideways")


@pytest.mark.parametrize("name", ["tcp", "shm", "inproc"])
def test_host_only_transports_refuse_device_memory_naming_what_they_move(name: str) -> None:
    transport = transports.create(name)
    assert transport.memory_kinds() == HOST_ONLY
    with pytest.raises(ValueError, match=rf"the {name} transport cannot land chunks in cuda:0 memory: it sends "
                                         r"from host memory, lands in host memory"):
        transport.allocate(1, 64, "cuda:0")
    shaped = transports.create(name, bandwidth="1Gbit")  # a wrapper says what the transport under it moves
    assert shaped.memory_kinds() == HOST_ONLY
    with pytest.raises(ValueError, match="cannot land chunks in cuda:0"):
        shaped.allocate(1, 64, "cuda:0")


async def test_a_pool_never_holds_more_than_its_capacity_and_makes_the_next_lease_wait() -> None:
    mib = 1 << 20
    pool = StagingPool(4 * mib, pinned=False)
    with pytest.raises(ValueError, match=f"{4 * mib + 1} bytes to stage at once, more than the pool's {4 * mib}"):
        async with pool.lease(4 * mib + 1):
            pass
    order = []

    async def hold(name: str, nbytes: int, seconds: float) -> None:
        async with pool.lease(nbytes) as buffer:
            order.append(f"{name} in")
            assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
            assert pool.in_use_bytes <= pool.capacity_bytes
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    first = asyncio.create_task(hold("a", 3 * mib // 2, 0.05))  # a 2 MiB buffer
    await asyncio.sleep(0)
    second = asyncio.create_task(hold("b", 3 * mib, 0))  # 4 MiB: waits for a
    third = asyncio.create_task(hold("c", 5 * mib // 4, 0))  # 2 MiB: fits beside a, does not queue behind b
    await asyncio.gather(first, second, third)
    assert order.index("c in") < order.index("a out") < order.index("b in")
    assert pool.waits == 1 and pool.peak_bytes == 4 * mib and pool.in_use_bytes == 0


async def test_leases_of_different_lengths_reuse_one_buffer() -> None:
    pool = StagingPool(64 << 20, pinned=False)
    assert [pool.size_for(n) for n in (0, 1, 65536, 65537, 3 << 20, 100 << 20)] == \
        [65536, 65536, 65536, 131072, 4 << 20, 64 << 20]
    pointers = []
    for nbytes in (3 << 20, (3 << 20) + 12345, 4 << 20):  # one layer's KV, prompts of different lengths
        async with pool.lease(nbytes) as buffer:
            assert buffer.numel() == nbytes
            pointers.append(buffer.data_ptr())
    assert len(set(pointers)) == 1 and pool.peak_bytes == 4 << 20


async def test_a_lease_cancelled_while_waiting_or_holding_leaves_the_pool_as_it_was() -> None:
    pool = StagingPool(1 << 20, pinned=False)
    async with pool.lease(800 << 10):  # a 1 MiB buffer: the whole pool
        waiting = asyncio.create_task(pool.lease(100).__aenter__())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert pool.in_use_bytes == 0

    async def hold() -> None:
        async with pool.lease(1 << 20):
            await asyncio.sleep(10)

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    assert pool.in_use_bytes == 1 << 20
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert pool.in_use_bytes == 0
    async with pool.lease(100) as buffer:  # the kept 1 MiB buffer is dropped to make room
        assert buffer.numel() == 100 and pool.in_use_bytes == 64 << 10


async def test_host_tensors_are_not_staged() -> None:
    stager = Stager(StagingPool(1 << 20, pinned=False))
    keys, values = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    async with stager.to_host([keys, values]) as (k, v):
        assert k is keys and v is values
    assert stager.copied_bytes == 0 and stager.pool.peak_bytes == 0
    stager.close()


async def test_copies_run_off_the_event_loop() -> None:
    """A copy large enough to take tens of milliseconds: the loop keeps ticking meanwhile."""
    stager = Stager(StagingPool(1 << 20, pinned=False))
    source = torch.randn(64 << 20)  # 256 MiB
    target = torch.empty_like(source)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.005)
    before = ticks
    await stager.to_device([(target, source)])
    ticker.cancel()
    assert torch.equal(target, source) and stager.copied_bytes == source.numel() * 4
    assert ticks - before >= 3, "the event loop stood still while the copy ran"
    stager.close()


# --- on a GPU (scripts/device_check.sh); skipped without one ----------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device_check.sh)")


@cuda
async def test_device_bytes_reach_pinned_host_memory_after_the_producer_and_come_back() -> None:
    stager = Stager()
    a = torch.randn(2048, 2048, device="cuda")
    keys = (a @ a).contiguous()  # still computing when the copy is queued: the event orders them
    values = torch.arange(1 << 20, device="cuda", dtype=torch.float16)
    ready = torch.cuda.current_stream().record_event()
    async with stager.to_host([keys, values], ready) as (k, v):
        assert k.is_pinned() and v.is_pinned() and k.device.type == "cpu"
        assert torch.equal(k, keys.cpu()) and torch.equal(v, values.cpu())
        back_k, back_v = torch.empty_like(keys), torch.empty_like(values)
        await stager.to_device([(back_k, k), (back_v, v)])
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)
    assert stager.pool.in_use_bytes == 0 and stager.pool.peak_bytes == stager.pool.size_for(keys.nbytes + values.nbytes)
    stager.close()


@cuda
async def test_a_staged_copy_leaves_the_compute_stream_free() -> None:
    """While a large device-to-host copy runs on the stager's stream, work queued on the compute
    stream after it finishes before the copy does (the compute stream does not wait for it)."""
    stager = Stager(StagingPool(1 << 30))
    big = torch.randn(200 << 20, device="cuda")  # 800 MiB: tens of milliseconds over PCIe
    small = torch.randn(256, 256, device="cuda")
    lease = stager.to_host([big])
    copying = asyncio.create_task(lease.__aenter__())
    await asyncio.sleep(0.002)  # the copy is queued on its stream by now
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        small = small @ small / 256
    end.record()
    end.synchronize()
    assert not copying.done(), "the copy finished first: too small to show anything"
    (host,) = await copying
    assert torch.equal(host[:1000], big[:1000].cpu())
    await lease.__aexit__(None, None, None)
    assert stager.pool.in_use_bytes == 0
    stager.close()
