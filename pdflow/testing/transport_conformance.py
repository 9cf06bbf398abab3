"""Conformance checks every pdflow transport must pass (in the spirit of trio's ``_check_streams``).

Each check is an ``async def check_*(harness)`` that raises AssertionError (or the unexpected
error) on failure and :class:`Unsupported` when the harness cannot run it. A :class:`Harness`
tells the checks how to make transports and how to run a peer that can die abruptly::

    from pdflow.testing.transport_conformance import harness_for, run_all
    await run_all(harness_for("tcp"))         # or pick checks from CHECKS

Peers of cross-process transports run in a child process (``python -c``) that is SIGKILLed;
for in-process transports closing the peer stands in for its death. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdflow.transports.checksum import checksum
from pdflow.messages import KvChunkHeader
from pdflow.transports import (
    ChecksumMismatch,
    IncompatiblePeer,
    OutOfBounds,
    PeerDisconnected,
    PeerUnreachable,
    Transport,
    TransportClosed,
    UnknownRegion,
    byte_view,
    create,
    load,
)

TIMEOUT_S = 20.0  # any single wait inside a check
STARTUP_S = 60.0  # a child peer starting (ucx: its worker too); slow machines take a while
SIZES = (0, 1, 12345, 64 << 20)
BIG = 64 << 20
STREAM = 16  # chunks of BIG in a row: more than any socket buffers hold, so a stalled peer blocks us
GUARD, GUARD_BYTE = 64, 0xA5
_rng = random.Random(20240607)  # reproducible payloads


class Unsupported(Exception):
    """The harness cannot run this check (e.g. an in-process peer cannot die mid-payload)."""


def header(
    region: int, offset: int, data: Any, *, bad_checksum: bool = False, layer: int = 0
) -> KvChunkHeader:
    """A raw-bytes chunk header for ``data`` (any buffer or tensor) with its checksum (or a wrong one)."""
    view = byte_view(data)
    nbytes, digest = view.nbytes, checksum(view) ^ (1 if bad_checksum else 0)
    return KvChunkHeader("conformance", layer, -1, 0, 0, "uint8", (nbytes,), region, offset, nbytes, digest)


def guarded(nbytes: int) -> bytearray:
    """A region of ``nbytes`` plus GUARD bytes either side, all GUARD_BYTE."""
    return bytearray([GUARD_BYTE]) * (nbytes + 2 * GUARD)


async def _wait(awaitable: Awaitable[Any], timeout: float = TIMEOUT_S) -> Any:
    return await asyncio.wait_for(awaitable, timeout)


async def _expect(error: type[Exception] | tuple[type[Exception], ...], awaitable: Awaitable[Any]) -> None:
    try:
        await _wait(awaitable)
    except error:
        return
    raise AssertionError(f"expected {error}, the call succeeded")


async def _notice_ok(receiver: Transport, expected: KvChunkHeader, timeout: float = TIMEOUT_S) -> None:
    notice = await _wait(receiver.next_notice(), timeout)
    assert notice.error is None, f"chunk failed to land: {notice.error!r}"
    assert notice.header == expected and notice.received_at > 0


class Peer(ABC):
    """A transport endpoint elsewhere that can die abruptly."""

    address: str = ""

    async def freeze(self) -> bool:
        """Stop it reading while it stays alive; False if this peer cannot do that."""
        return False

    @abstractmethod
    async def kill(self) -> None:
        """Kill it now: the first thing this does, before any await, is the kill itself."""


@dataclass
class Harness:
    """How the checks reach a transport implementation.

    ``make(host=..., port=...)``: a new, unstarted transport (the defaults pick a free address).
    ``spawn_receiver(region, nbytes)``: a started receiver elsewhere with that region registered.
    ``spawn_sender(address, headers)``: a sender elsewhere writing zero-filled chunks for
    ``headers`` to ``address`` one after another; None if a sender cannot die mid-payload.
    """

    make: Callable[..., Transport]
    spawn_receiver: Callable[[int, int], Awaitable[Peer]]
    spawn_sender: Callable[[str, list[KvChunkHeader]], Awaitable[Peer]] | None = None


# --- peers ---------------------------------------------------------------------------------


class _LocalPeer(Peer):
    def __init__(self, transport: Transport) -> None:
        self.transport, self.address = transport, transport.address

    async def kill(self) -> None:
        await self.transport.aclose()


class _ProcessPeer(Peer):
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def freeze(self) -> bool:
        os.kill(self.process.pid, signal.SIGSTOP)
        return True

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await _wait(self.process.wait())
        if self.process.stdin is not None:
            self.process.stdin.close()


async def _spawn(role: str, name: str, spec: dict[str, Any]) -> _ProcessPeer:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    code = "from pdflow.testing.transport_conformance import peer_main; peer_main()"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, role, name, msgspec.json.encode(spec).decode(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    return _ProcessPeer(process)


def process_harness(name: str, **options: Any) -> Harness:
    """Peers in child processes, for transports that work across processes (tcp, ucx, ...)."""

    async def spawn_receiver(region: int, nbytes: int) -> Peer:
        peer = await _spawn("receiver", name, {"options": options, "region": region, "nbytes": nbytes})
        try:
            line = await _wait(peer.process.stdout.readline(), STARTUP_S)  # type: ignore[union-attr]
        except BaseException:
            await peer.kill()
            raise
        assert line.startswith(b"ready "), f"receiver peer failed to start: {line!r}"
        peer.address = line.split()[1].decode()
        return peer

    async def spawn_sender(address: str, headers: list[KvChunkHeader]) -> Peer:
        return await _spawn("sender", name, {"options": options, "address": address, "headers": headers})

    return Harness(lambda **kw: create(name, **{**options, **kw}), spawn_receiver, spawn_sender)


def local_harness(name: str, **options: Any) -> Harness:
    """Peers in this process (closing one stands in for its death): for inproc-like transports."""

    async def spawn_receiver(region: int, nbytes: int) -> Peer:
        transport = create(name, **options)
        await transport.start()
        transport.register(region, bytearray(nbytes))
        return _LocalPeer(transport)

    return Harness(lambda **kw: create(name, **{**options, **kw}), spawn_receiver, None)


def harness_for(name: str, **options: Any) -> Harness:
    """The right harness for registered transport ``name``."""
    return (process_harness if load(name).cross_process else local_harness)(name, **options)


def peer_main() -> None:
    """Entry of a child peer: ``role name spec-json``. Dies when its parent closes stdin."""
    import structlog
    import threading

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    role, name, spec = sys.argv[1], sys.argv[2], msgspec.json.decode(sys.argv[3])
    asyncio.run(_peer(role, name, spec))


async def _peer(role: str, name: str, spec: dict[str, Any]) -> None:
    transport = create(name, **spec["options"])
    if role == "receiver":
        await transport.start()
        transport.register(spec["region"], bytearray(spec["nbytes"]))
        sys.stdout.write(f"ready {transport.address}\n")
        sys.stdout.flush()
        while True:
            await transport.next_notice()
    for chunk in msgspec.convert(spec["headers"], list[KvChunkHeader]):
        await transport.write(spec["address"], chunk, bytes(chunk.nbytes))
    await asyncio.Event().wait()  # stay until killed


# --- the checks ----------------------------------------------------------------------------


async def check_sizes(h: Harness) -> None:
    """Chunks of 0, 1, odd and 64 MiB land intact, at their offset only (guards untouched)."""
    async with h.make() as receiver, h.make() as sender:
        for region, size in enumerate(SIZES):
            buffer, data = guarded(size), _rng.randbytes(size)
            receiver.register(region, buffer)
            chunk = header(region, GUARD, data)
            await _wait(sender.write(receiver.address, chunk, data))
            await _notice_ok(receiver, chunk)
            assert buffer[GUARD : GUARD + size] == data, f"{size}-byte chunk landed wrong"
            assert buffer[:GUARD] == buffer[GUARD + size :] == guarded(0)[:GUARD], "wrote outside its span"


async def check_buffers(h: Harness) -> None:
    """Tensors and buffers of any kind travel from their own memory; bad ones are ValueErrors."""
    import torch

    async with h.make() as receiver, h.make() as sender:
        landing = torch.zeros(4096, dtype=torch.uint8)
        receiver.register(1, landing)
        source = torch.arange(256, dtype=torch.float32)  # 1 KiB, not uint8
        for i, data in enumerate([source, memoryview(source.numpy()), bytearray(b"xyz")]):
            chunk = header(1, 1024 * i, data)
            await _wait(sender.write(receiver.address, chunk, data))
            await _notice_ok(receiver, chunk)
        assert torch.equal(landing[1024:2048].view(torch.float32), source)
        assert bytes(landing[2048:2051]) == b"xyz"
        for bad in (source[::2], source.view(16, 16).t()):  # not contiguous
            await _expect(ValueError, sender.write(receiver.address, header(1, 0, bad.contiguous()), bad))
        await _expect(ValueError, sender.write(receiver.address, header(1, 0, b"four"), b"five!"))
        for region, buffer in [(1, bytearray(8)), (2, b"read-only")]:  # id taken; not writable
            try:
                receiver.register(region, buffer)
            except ValueError:
                continue
            raise AssertionError(f"register({region}, {type(buffer).__name__}) was accepted")
        receiver.unregister(2)  # never registered: idempotent


async def check_many_in_flight(h: Harness, receivers: int = 3, per_receiver: int = 100) -> None:
    """Hundreds of concurrent writes from two senders to several receivers all land, in place;
    each sender counts the bytes it wrote to each receiver."""
    slot = 16 << 10
    async with h.make() as s1, h.make() as s2:
        targets = [h.make() for _ in range(receivers)]
        try:
            writes, expected = [], []
            for target in targets:
                await target.start()
                buffer = bytearray([GUARD_BYTE]) * (slot * per_receiver)
                target.register(7, buffer)
                chunks = {}
                for i in range(per_receiver):  # chunk i in slot i, at least GUARD bytes short of it
                    data = _rng.randbytes(_rng.randint(1, slot - GUARD))
                    chunk = header(7, i * slot, data, layer=i)
                    chunks[i] = (chunk, data)
                    writes.append((s1 if i % 2 else s2).write(target.address, chunk, data))
                expected.append((target, buffer, chunks))
            await _wait(asyncio.gather(*writes))
            for target, buffer, chunks in expected:
                landed = set()
                for _ in chunks:
                    notice = await _wait(target.next_notice())
                    assert notice.error is None, f"chunk failed to land: {notice.error!r}"
                    assert notice.header == chunks[notice.header.layer][0]
                    landed.add(notice.header.layer)
                assert landed == set(chunks), "a notice came twice"
                for chunk, data in chunks.values():
                    end, slot_end = chunk.offset + chunk.nbytes, chunk.offset + slot
                    assert buffer[chunk.offset : end] == data, "a chunk landed wrong"
                    untouched = bytes([GUARD_BYTE]) * (slot_end - end)
                    assert buffer[end:slot_end] == untouched, "wrote past its span"
            # each sender counts what it wrote to each receiver (the per-link byte counts)
            for sender, odd in ((s1, 1), (s2, 0)):
                wrote = {target.address: sum(chunk.nbytes for i, (chunk, _) in chunks.items() if i % 2 == odd)
                         for target, _, chunks in expected}
                assert sender.sent_by_peer() == wrote, "sent_by_peer() miscounts"
                assert sender.sent_bytes == sum(wrote.values())
        finally:
            for target in targets:
                await target.aclose()


async def check_bad_chunks(h: Harness) -> None:
    """Checksum mismatch, unknown region, out of bounds and unregistered regions are reported
    in notices; nothing outside the region is touched and the connection stays usable."""
    async with h.make() as receiver, h.make() as sender:
        buffer = guarded(4096)
        receiver.register(1, memoryview(buffer)[GUARD : GUARD + 4096])
        receiver.register(2, bytearray(16))
        receiver.unregister(2)
        data = _rng.randbytes(1 << 20)
        cases = [
            (header(1, 0, data[:4096], bad_checksum=True), data[:4096], ChecksumMismatch),
            (header(999, 0, data), data, UnknownRegion),
            (header(1, 4000, data[:200]), data[:200], OutOfBounds),
            (header(1, -1, data[:10]), data[:10], OutOfBounds),
            (header(2, 0, data[:8]), data[:8], UnknownRegion),
        ]
        for chunk, payload, error in cases:
            await _wait(sender.write(receiver.address, chunk, payload))
            notice = await _wait(receiver.next_notice())
            assert isinstance(notice.error, error), f"expected {error.__name__}, got {notice.error!r}"
            assert notice.header == chunk
        assert buffer[:GUARD] == buffer[GUARD + 4096 :] == guarded(0)[:GUARD], "wrote outside the region"
        good = header(1, 0, data[:4096])
        await _wait(sender.write(receiver.address, good, data[:4096]))
        await _notice_ok(receiver, good)


async def check_authentication(h: Harness) -> None:
    """With the pipeline's data-plane key both ends prove it in the handshake: a sender with
    another key, or none, is refused (IncompatiblePeer) before any region is written, and a
    sender with a key is refused by a receiver that has none; the same key writes as ever."""
    if not h.make().cross_process:
        raise Unsupported("its peers share this process: there is nothing to prove")
    key, other = os.urandom(32), os.urandom(32)
    async with h.make() as receiver:
        receiver.authenticate(key)
        await receiver.start()
        buffer = guarded(64)
        receiver.register(1, memoryview(buffer)[GUARD : GUARD + 64])
        data = _rng.randbytes(64)
        for wrong in (other, None):
            async with h.make() as sender:
                sender.authenticate(wrong)
                await _expect(IncompatiblePeer, sender.write(receiver.address, header(1, 0, data), data))
        assert buffer == guarded(64), "a refused sender wrote into the region"
        async with h.make() as sender:
            sender.authenticate(key)
            chunk = header(1, 0, data)
            await _wait(sender.write(receiver.address, chunk, data))
            await _notice_ok(receiver, chunk)
            assert buffer[GUARD : GUARD + 64] == data
    async with h.make() as open_receiver, h.make() as sender:
        await open_receiver.start()
        open_receiver.register(1, bytearray(64))
        sender.authenticate(key)
        await _expect(IncompatiblePeer, sender.write(open_receiver.address, header(1, 0, data), data))


async def check_close_while_busy(h: Harness) -> None:
    """aclose() during many writes and a pending next_notice(): every call ends, typed."""
    async with h.make() as receiver:
        receiver.register(1, bytearray(256 << 10))
        sender = h.make()
        data = bytes(256 << 10)
        chunk = header(1, 0, data)
        # connect first, so that the close below cuts into a busy stream
        await _wait(sender.write(receiver.address, chunk, data), STARTUP_S)
        writes = [asyncio.ensure_future(sender.write(receiver.address, chunk, data)) for _ in range(200)]
        await asyncio.sleep(0.002)
        await _wait(sender.aclose())
        for outcome in await _wait(asyncio.gather(*writes, return_exceptions=True)):
            assert outcome is None or isinstance(outcome, TransportClosed), f"write ended with {outcome!r}"
        await _wait(sender.aclose())  # idempotent
        await _expect(TransportClosed, sender.write(receiver.address, chunk, data))
    other = h.make()
    await other.start()
    waiter = asyncio.ensure_future(other.next_notice())
    await asyncio.sleep(0.01)
    await _wait(other.aclose())
    await _expect(TransportClosed, waiter)
    await _expect(TransportClosed, other.next_notice())


async def _stream(sender: Transport, address: str, count: int = STREAM) -> None:
    """``count`` chunks of BIG bytes to region 1 at offset 0 of ``address``, one after another."""
    data = bytes(BIG)
    chunk = header(1, 0, data)
    for _ in range(count):
        await sender.write(address, chunk, data)


async def check_receiver_dies(h: Harness) -> None:
    """A receiver that dies mid-transfer: the write raises PeerDisconnected, no hang; later
    writes raise PeerDisconnected or PeerUnreachable."""
    peer = await h.spawn_receiver(1, BIG)
    async with h.make() as sender:
        try:
            small = bytes(1024)
            await _wait(sender.write(peer.address, header(1, 0, small), small), STARTUP_S)
            frozen = await peer.freeze()
            writing = asyncio.ensure_future(_stream(sender, peer.address, STREAM if frozen else 1))
            await asyncio.sleep(0.3)
            assert not (frozen and writing.done()), "1 GiB of writes to a frozen peer did not block"
        finally:
            await peer.kill()
        outcome = (await _wait(asyncio.gather(writing, return_exceptions=True)))[0]
        if frozen:  # it was mid-payload
            assert isinstance(outcome, PeerDisconnected), f"write ended with {outcome!r}"
        else:
            assert outcome is None or isinstance(outcome, (PeerDisconnected, PeerUnreachable)), repr(outcome)
        later = sender.write(peer.address, header(1, 0, small), small)
        await _expect((PeerDisconnected, PeerUnreachable), later)


async def check_close_while_blocked(h: Harness) -> None:
    """aclose() while a write is stuck on a peer that stopped reading ends it with TransportClosed."""
    peer = await h.spawn_receiver(1, BIG)
    try:
        sender = h.make()
        small = bytes(1024)
        await _wait(sender.write(peer.address, header(1, 0, small), small), STARTUP_S)
        if not await peer.freeze():
            raise Unsupported("this harness's peers cannot stop reading (writes never block)")
        writing = asyncio.ensure_future(_stream(sender, peer.address))
        await asyncio.sleep(0.3)
        assert not writing.done(), "1 GiB of writes to a frozen peer did not block"
        await _wait(sender.aclose())
        await _expect(TransportClosed, writing)
    finally:
        await peer.kill()


async def check_sender_dies(h: Harness) -> None:
    """A sender that dies mid-payload: the receiver gets a PeerDisconnected notice for it."""
    if h.spawn_sender is None:
        raise Unsupported("writes are atomic here: a sender cannot die mid-payload")
    async with h.make() as receiver:
        receiver.register(1, bytearray(BIG))
        first, big = header(1, 0, bytes(1024)), header(1, 0, bytes(BIG))
        peer = await h.spawn_sender(receiver.address, [first] + [big] * STREAM)
        try:
            await _notice_ok(receiver, first, STARTUP_S)
            time.sleep(0.5)  # block our loop on purpose: the sender stalls mid-payload on full buffers
        finally:
            await peer.kill()
        for _ in range(STREAM):  # what the socket buffers held lands; then the cut chunk
            notice = await _wait(receiver.next_notice())
            assert notice.header == big
            if notice.error is not None:
                break
        assert isinstance(notice.error, PeerDisconnected), f"expected PeerDisconnected, got {notice.error!r}"


async def check_reconnect(h: Harness) -> None:
    """A receiver restarted at the same address is reached again by the same sender."""
    async with h.make() as sender:
        receiver = h.make()
        await receiver.start()
        address, data = receiver.address, b"before restart"
        receiver.register(1, bytearray(64))
        await _wait(sender.write(address, header(1, 0, data), data))
        await _notice_ok(receiver, header(1, 0, data))
        await receiver.aclose()
        await _expect((PeerDisconnected, PeerUnreachable), sender.write(address, header(1, 0, data), data))
        parts = urlsplit(address)
        async with h.make(host=parts.hostname, port=parts.port) as again:
            assert again.address == address
            again.register(1, bytearray(64))
            chunk, data = header(1, 8, b"after restart"), b"after restart"
            try:
                await _wait(sender.write(address, chunk, data))
            except PeerDisconnected:  # allowed once: the write that finds the old connection broken
                await _wait(sender.write(address, chunk, data))
            await _notice_ok(again, chunk)


async def check_peer_memory(h: Harness) -> None:
    """``peer_memory`` is None, or the receiver's region mapped here: what the sender writes into
    it is in the region, a write from that very memory lands with its notice (checksum verified)
    and leaves the bytes as they were, and a region the sender cannot map gives None."""
    async with h.make() as receiver, h.make() as sender:
        landing = receiver.allocate(1, 1 << 20)
        view = await _wait(sender.peer_memory(receiver.address_for(1), 1))
        if view is None:
            raise Unsupported(f"{sender.name} shares no memory with its peers")
        assert view.nbytes >= 1 << 20 and not view.readonly
        data = _rng.randbytes(4096)
        view[8192 : 8192 + 4096] = data
        assert bytes(landing[8192 : 8192 + 4096]) == data, "bytes written into the mapping are not in the region"
        chunk = header(1, 8192, data)
        await _wait(sender.write(receiver.address_for(1), chunk, view[8192 : 8192 + 4096]))
        await _notice_ok(receiver, chunk)
        assert bytes(landing[8192 : 8192 + 4096]) == data
        bad = header(1, 0, view[:64], bad_checksum=True)  # in place, but not what the header says
        await _wait(sender.write(receiver.address_for(1), bad, view[:64]))
        notice = await _wait(receiver.next_notice())
        assert isinstance(notice.error, ChecksumMismatch), notice.error
        receiver.register(2, bytearray(64))  # the receiver's private memory
        assert await _wait(sender.peer_memory(receiver.address_for(2), 2)) is None


async def check_advertised_address(h: Harness) -> None:
    """A receiver that binds every address (``0.0.0.0``) and advertises one peers can reach
    (:meth:`Transport.advertise`) names that one in its address, where a sender's chunk lands;
    a transport whose addresses name no network host (shm's a segment, inproc's a receiver in
    this process) keeps its own."""
    async with h.make(host="0.0.0.0") as receiver, h.make() as sender:
        receiver.advertise("127.0.0.1")
        await receiver.start()
        address = receiver.address
        parts = urlsplit(address)
        if receiver.cross_process and parts.hostname is not None and parts.port is not None:  # a network address
            assert parts.hostname == "127.0.0.1", f"advertised 127.0.0.1, the address says {address!r}"
        assert receiver.address_for(0) == address
        buffer, data = guarded(100), _rng.randbytes(100)
        receiver.register(0, buffer)
        chunk = header(0, GUARD, data)
        await _wait(sender.write(address, chunk, data))
        await _notice_ok(receiver, chunk)
        assert buffer[GUARD : GUARD + 100] == data


async def check_memory_kinds(h: Harness) -> None:
    """Every pair of memory kinds the transport declares (:meth:`Transport.memory_kinds`) moves a
    chunk intact, from a tensor in the source kind into a region it allocated in the landing kind;
    a kind it does not land in is refused by ``allocate`` and one it does not send from by
    ``write``, with ValueErrors. Device pairs need a CUDA device (skipped without one)."""
    import torch

    from pdflow.transports.memory import DEVICE, HOST, cuda_missing

    async with h.make() as receiver, h.make() as sender:
        kinds, skipped = sender.memory_kinds(), []
        for region, (source, landing) in enumerate(kinds.pairs()):
            if DEVICE in (source, landing) and (why := cuda_missing()) is not None:
                skipped.append(f"{source}->{landing}")
                continue
            memory = HOST if landing == HOST else "cuda:0"
            span = receiver.allocate(region, 3 * 4096 + 8, memory)
            data = torch.frombuffer(bytearray(_rng.randbytes(3 * 4096)), dtype=torch.uint8)
            chunk = header(region, 8, data)  # the checksum of the bytes, hashed where they are host memory
            if source == DEVICE:
                data = data.to("cuda:0")
            await _wait(sender.write(receiver.address_for(region), chunk, data))
            await _notice_ok(receiver, chunk)
            landed = span if landing == HOST else span.cpu().numpy()
            assert bytes(landed[8 : 8 + 3 * 4096]) == bytes(data.cpu().numpy()), f"{source}->{landing} landed wrong"
        if DEVICE not in kinds.lands:
            try:
                receiver.allocate(99, 64, "cuda:0")
            except ValueError:
                pass
            else:
                raise AssertionError("allocate() in device memory was accepted by a transport that lands in host only")
        if DEVICE not in kinds.reads:  # a tensor in device memory (a meta tensor has none: no GPU needed)
            receiver.register(98, bytearray(64))
            away = torch.empty(64, dtype=torch.uint8, device="meta")
            await _expect(ValueError, sender.write(receiver.address, header(98, 0, bytes(64)), away))
        if skipped:
            raise Unsupported(f"{', '.join(skipped)} need a CUDA device: {why}")


CHECKS = (
    check_sizes,
    check_memory_kinds,
    check_advertised_address,
    check_buffers,
    check_many_in_flight,
    check_bad_chunks,
    check_authentication,
    check_close_while_busy,
    check_close_while_blocked,
    check_receiver_dies,
    check_sender_dies,
    check_reconnect,
    check_peer_memory,
)


async def run_all(h: Harness) -> list[str]:
    """Run every check; returns the skipped ones as ``"name: reason"``."""
    skipped = []
    for check in CHECKS:
        try:
            await check(h)
        except Unsupported as exc:
            skipped.append(f"{check.__name__}: {exc}")
    return skipped
