"""The transport registry, and the conformance suite for every transport usable here."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import sys
from pathlib import Path

import pytest
import uvloop

from pdflow import transports
from pdflow.testing.transport_conformance import CHECKS, Unsupported, harness_for, header, run_all
from pdflow.transports import (
    ChecksumMismatch,
    IncompatiblePeer,
    OutOfBounds,
    PeerDisconnected,
    PeerUnreachable,
    UnknownRegion,
)

CHECK_TIMEOUT_S = 120.0  # a check waits at most 20 s at a time; this is the backstop


@pytest.fixture(params=transports.names())
def harness(request: pytest.FixtureRequest):
    reason = transports.availability(request.param)
    if reason is not None:
        pytest.skip(reason)
    return harness_for(request.param)


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
async def test_conformance(harness, check) -> None:
    try:
        await asyncio.wait_for(check(harness), CHECK_TIMEOUT_S)
    except Unsupported as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_conformance_under_uvloop(name: str) -> None:
    if transports.availability(name) is not None:
        pytest.skip(transports.availability(name))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        skipped = runner.run(asyncio.wait_for(run_all(harness_for(name)), 4 * CHECK_TIMEOUT_S))
    assert skipped == ([] if name == "shm" else ["check_peer_memory: tcp shares no memory with its peers"])


# --- registry ------------------------------------------------------------------------------


def test_builtin_names_and_availability() -> None:
    assert transports.names()[:5] == ["tcp", "inproc", "shm", "ucx", "verbs"]
    assert transports.availability("tcp") is None and transports.availability("inproc") is None
    assert type(transports.create("inproc")).__name__ == "InProcTransport"
    tcp = transports.create("tcp", "127.0.0.1", 0, timeout_s=1.0)
    assert tcp.name == "tcp" and tcp.timeout_s == 1.0


def test_unavailable_transports_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("ucxx", "pyverbs", "pdflow.transports.ucx", "pdflow.transports.ucx_link",
                   "pdflow.transports.ucx_worker", "pdflow.transports.verbs"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed (None: ImportError)
    transports.registry.refresh()
    try:
        assert "pip install 'pdflow[ucx]'" in transports.availability("ucx")
        assert "python3-pyverbs" in transports.availability("verbs")
        with pytest.raises(ImportError, match=r"pdflow\[ucx\]"):
            transports.load("ucx")
    finally:
        transports.registry.refresh()


def test_verbs_says_why_it_cannot_run_here() -> None:
    """Without pyverbs: the install hint; with pyverbs but no RDMA device: that, plainly."""
    reason = transports.availability("verbs")
    if reason is not None:
        assert "python3-pyverbs" in reason
        assert "No module named 'pyverbs'" in reason or "no RDMA device" in reason, reason


def test_unknown_transport() -> None:
    reason = transports.availability("carrier-pigeon")
    assert reason.startswith("unknown transport 'carrier-pigeon'; known: tcp, inproc")
    with pytest.raises(LookupError, match="carrier-pigeon"):
        transports.create("carrier-pigeon")


def test_entry_point_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    group = transports.ENTRY_POINT_GROUP
    plugins = {
        "plugin": EntryPoint("plugin", "pdflow.transports.inproc:InProcTransport", group),
        "broken": EntryPoint("broken", "no_such_module_xyz:Thing", group),
    }
    transports.registry.refresh()
    monkeypatch.setattr(transports.registry, "_entry_points", plugins)
    try:
        assert transports.names()[-2:] == ["plugin", "broken"]
        assert transports.load("plugin").name == "inproc"
        assert "failed to load" in transports.availability("broken")
    finally:
        transports.registry.refresh()


def test_the_host_an_address_names_and_those_that_never_leave_the_machine() -> None:
    assert transports.address_host("tcp://10.0.0.2:5630") == "10.0.0.2"
    assert transports.address_host("ucx://[fd00::2]:5640") == "fd00::2"
    assert transports.address_host("verbs://10.0.0.3:5640/7") == "10.0.0.3"
    assert transports.address_host("shm://@10.0.0.2:5630") is None
    from pdflow.transports.base import with_host

    assert with_host("tcp://0.0.0.0:5630", "10.0.0.2") == "tcp://10.0.0.2:5630"
    assert with_host("shm://@0.0.0.0:5630", "10.0.0.2") == "shm://@0.0.0.0:5630"  # a socket's name: as it is
    assert transports.address_host("inproc://127.0.0.1:1") is None
    assert transports.address_host("junk") is None
    assert transports.shares_memory("shm") and not transports.shares_memory("tcp")


def test_unknown_options_are_rejected() -> None:
    with pytest.raises(TypeError, match="timeout"):
        transports.create("tcp", timeuot_s=3)


# --- the shared write path (Transport.write) ---------------------------------------------------


@pytest.mark.parametrize("name", transports.names())
async def test_writes_to_one_address_land_in_call_order(name: str) -> None:
    if (reason := transports.availability(name)) is not None:
        pytest.skip(reason)
    async with transports.create(name) as receiver, transports.create(name) as sender:
        receiver.register(1, bytearray(64 << 10))
        payloads = [random.randbytes(n) for n in (1000, 0, 1, 1024, 77) * 8]
        chunks = [(header(1, i * 1024, data, layer=i), data) for i, data in enumerate(payloads)]
        address = receiver.address_for(1)
        await asyncio.wait_for(asyncio.gather(*(sender.write(address, c, d) for c, d in chunks)), 20)
        notices = [await asyncio.wait_for(receiver.next_notice(), 20) for _ in chunks]
    assert [n.header.layer for n in notices] == list(range(len(chunks)))
    assert all(n.error is None for n in notices), notices


def _silent_listener(name: str) -> tuple[socket.socket, str]:
    """A listener whose connections the kernel accepts but nobody answers, and its address."""
    if name == "shm":
        sock, label = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), f"pdflow-silent-{os.getpid()}"
        sock.bind("\0" + label)
        sock.listen(64)
        return sock, f"shm://@{label}"
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, f"{name}://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("name", ["tcp", "shm", "ucx"])
async def test_writes_queued_behind_a_failed_connect_fail_fast(name: str) -> None:
    """A peer that accepts but never answers: one connect timeout, not one per queued write."""
    if (reason := transports.availability(name)) is not None:
        pytest.skip(reason)
    silent, address = _silent_listener(name)
    with silent:
        async with transports.create(name, timeout_s=0.5) as sender:
            loop = asyncio.get_running_loop()
            started = loop.time()
            writes = [sender.write(address, header(1, 0, b"x"), b"x") for _ in range(20)]
            outcomes = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 10)
            assert all(isinstance(o, PeerUnreachable) for o in outcomes), outcomes
            assert loop.time() - started < 3


# --- tcp specifics -------------------------------------------------------------------------


async def test_tcp_handshake_rejects_other_versions() -> None:
    """A peer answering with another wire version gets a clear IncompatiblePeer."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def old_peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            conn.setblocking(False)
            await loop.sock_recv(conn, 8)
            await loop.sock_sendall(conn, struct.pack("!4sHH", b"PDKV", 99, 1))

    serving = asyncio.ensure_future(old_peer())
    async with transports.create("tcp", timeout_s=5) as sender:
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(IncompatiblePeer, match="wire 99"):
            await asyncio.wait_for(sender.write(address, header(1, 0, b"x"), b"x"), 10)
        with pytest.raises(ValueError, match="not a tcp address"):
            await sender.write("udp://nowhere", header(1, 0, b"x"), b"x")
    await asyncio.wait_for(serving, 5)
    listener.close()


async def test_tcp_unreachable_peer() -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    async with transports.create("tcp", timeout_s=5) as sender:
        with pytest.raises(PeerUnreachable):
            await asyncio.wait_for(sender.write(f"tcp://127.0.0.1:{port}", header(1, 0, b"x"), b"x"), 10)


# --- inproc specifics ----------------------------------------------------------------------


async def test_inproc_receiver_on_another_thread() -> None:
    """The notice is posted on the receiver's own loop, even when the sender runs elsewhere."""
    import threading

    receiver = transports.create("inproc")
    buffer = bytearray(16)
    started, landed = threading.Event(), []

    async def receive() -> None:
        await receiver.start()
        receiver.register(1, buffer)
        started.set()
        landed.append(await asyncio.wait_for(receiver.next_notice(), 10))
        await receiver.aclose()

    thread = threading.Thread(target=asyncio.run, args=(receive(),))
    thread.start()
    assert await asyncio.to_thread(started.wait, 10)
    async with transports.create("inproc") as sender:
        await sender.write(receiver.address, header(1, 4, b"hello"), b"hello")
    await asyncio.to_thread(thread.join, 10)
    assert landed and landed[0].error is None and buffer[4:9] == b"hello"


# --- ucx specifics (the conformance suite covers the rest) -------------------------------------

@pytest.fixture
def ucx_installed() -> None:
    """Skips where ucx cannot run (asked as a test starts: the answer imports ucxx, 0.4 s of CPU that
    every test worker paid to collect the tests when a skip mark asked it)."""
    if (reason := transports.availability("ucx")) is not None:
        pytest.skip(reason)


needs_ucx = pytest.mark.usefixtures("ucx_installed")


@needs_ucx
async def test_ucx_rejects_other_peers_and_addresses() -> None:
    """A tcp receiver answering the handshake: IncompatiblePeer; nothing there: PeerUnreachable."""
    free = socket.create_server(("127.0.0.1", 0))
    nobody = f"ucx://127.0.0.1:{free.getsockname()[1]}"
    free.close()
    async with transports.create("tcp") as tcp, transports.create("ucx", timeout_s=5) as sender:
        with pytest.raises(IncompatiblePeer, match="not a pdflow ucx endpoint"):
            await asyncio.wait_for(sender.write(tcp.address.replace("tcp:", "ucx:"), header(1, 0, b"x"), b"x"), 10)
        with pytest.raises(ValueError, match="not a ucx address"):
            await sender.write(tcp.address, header(1, 0, b"x"), b"x")
        with pytest.raises(PeerUnreachable):
            await asyncio.wait_for(sender.write(nobody, header(1, 0, b"x"), b"x"), 10)


@needs_ucx
def test_ucx_conformance_under_uvloop() -> None:
    from pdflow.testing import transport_conformance as tc

    checks = (tc.check_sizes, tc.check_many_in_flight, tc.check_close_while_blocked, tc.check_sender_dies)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for check in checks:
            runner.run(asyncio.wait_for(check(harness_for("ucx")), CHECK_TIMEOUT_S))


@needs_ucx
async def test_ucx_between_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender whose receiver is not in its network namespace (another machine, or another
    namespace on this one) makes its endpoints with UCX error handling: UCX then reports the
    peer's failure itself, and the next write to the gone peer must fail, not crash on an
    endpoint ucxx has already closed."""
    from pdflow.testing import transport_conformance as tc
    from pdflow.transports import ucx

    monkeypatch.setattr(ucx, "peer_is_local", lambda sock: False)
    for check in (tc.check_sizes, tc.check_many_in_flight, tc.check_receiver_dies, tc.check_reconnect):
        await asyncio.wait_for(check(harness_for("ucx")), CHECK_TIMEOUT_S)


def test_peer_is_local() -> None:
    from pdflow.transports.sockets import peer_is_local

    for peer, local in (("127.0.0.1", True), ("192.0.2.1", False)):  # TEST-NET-1: on no interface here
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))
            assert peer_is_local(sock) is local


# --- shm specifics: regions from allocate(), which senders map (the suite registers its own) ---

needs_shm = pytest.mark.skipif(transports.availability("shm") is not None, reason="shm is not available here")
LOOPS = pytest.mark.parametrize(
    "loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


def _kv_mappings() -> list[str]:
    """The shm segments mapped into this process."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "memfd:pdflow-kv-" in line]


async def _write_and_expect(sender, receiver, chunk, data, error=None) -> None:
    await asyncio.wait_for(sender.write(receiver.address, chunk, data), 20)
    notice = await asyncio.wait_for(receiver.next_notice(), 20)
    assert notice.header == chunk
    assert isinstance(notice.error, error) if error else notice.error is None, repr(notice.error)


async def _allocated_regions() -> None:
    from pdflow.testing.transport_conformance import GUARD, GUARD_BYTE, SIZES

    in_dev_shm = set(os.listdir("/dev/shm"))
    async with transports.create("shm") as receiver, transports.create("shm") as sender:
        guard = bytes([GUARD_BYTE]) * GUARD
        views = {}
        for region, size in enumerate(SIZES):  # 0, 1, odd, 64 MiB: in place, guards untouched
            views[region] = view = receiver.allocate(region, size + 2 * GUARD)
            view[:] = bytes([GUARD_BYTE]) * view.nbytes
            data = random.randbytes(size)
            await _write_and_expect(sender, receiver, header(region, GUARD, data), data)
            assert view[GUARD : GUARD + size] == data and view[:GUARD] == view[GUARD + size :] == guard
        link = sender._routes[receiver.address].link
        assert all(isinstance(link.mappings.get(r), tuple) for r in range(len(SIZES))), "not mapped"
        before = bytes(views[1])  # 1 + 2 * GUARD bytes
        cases = [  # region, offset, payload, bad checksum, the error in the notice
            (1, 0, b"x", True, ChecksumMismatch),
            (1, 100, b"y" * 80, False, OutOfBounds),
            (1, -1, b"z", False, OutOfBounds),
            (99, 0, b"w", False, UnknownRegion),
        ]
        for region, offset, data, bad, error in cases:
            await _write_and_expect(sender, receiver, header(region, offset, data, bad_checksum=bad), data, error)
        assert views[1][1:] == before[1:], "an out-of-bounds chunk wrote into the region"
        receiver.unregister(3)  # the sender is told to drop its mapping of the 64 MiB region
        for _ in range(200):
            if link.mappings.get(3) is None:
                break
            await asyncio.sleep(0.01)
        assert link.mappings.get(3) is None, "the sender kept a mapping of an unregistered region"
        again = receiver.allocate(3, 16)  # the same id, new memory: reached without a stale mapping
        await _write_and_expect(sender, receiver, header(3, 4, b"again"), b"again")
        assert again[4:9] == b"again"
        del view, views, again
    assert _kv_mappings() == [], "a segment outlived the transports and the caller's views"
    assert set(os.listdir("/dev/shm")) == in_dev_shm


@needs_shm
@LOOPS
def test_shm_allocated_regions_are_written_in_place(loop_factory) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(asyncio.wait_for(_allocated_regions(), CHECK_TIMEOUT_S))


@needs_shm
async def test_shm_writes_from_the_peers_memory_copy_nothing() -> None:
    """A chunk computed straight into the receiver's segment (through peer_memory) is written
    without a copy; any other write copies once; both land with their notices."""
    async with transports.create("shm") as receiver, transports.create("shm") as sender:
        landing = receiver.allocate(0, 1 << 20)
        view = await sender.peer_memory(receiver.address_for(0), 0)
        view[:4096] = data = random.randbytes(4096)
        await _write_and_expect(sender, receiver, header(0, 0, data), view[:4096])
        assert sender.copy_counts == {"copied_bytes": 0, "in_place_bytes": 4096}
        await _write_and_expect(sender, receiver, header(0, 4096, data), data)  # from elsewhere
        await _write_and_expect(sender, receiver, header(0, 8192, data), view[:4096])  # not its place
        assert sender.copy_counts == {"copied_bytes": 8192, "in_place_bytes": 4096}
        assert bytes(landing[:4096]) == bytes(landing[4096:8192]) == bytes(landing[8192:12288]) == data
        del view, landing


@needs_shm
async def test_shm_sender_lost_between_begin_and_end() -> None:
    """A sender gone after BEGIN (mid-copy) gives a PeerDisconnected notice for that chunk."""
    import msgspec

    from pdflow.transports import shm_wire as wire

    async with transports.create("shm") as receiver:
        receiver.allocate(1, 4096)
        loop, sock = asyncio.get_running_loop(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        with sock:
            await loop.sock_connect(sock, "\0" + receiver.address.removeprefix("shm://@"))
            assert await asyncio.wait_for(wire.GREETING.greet(sock, None), 10) is None
            chunk, encoded = header(1, 0, b"never ends"), msgspec.msgpack.encode(header(1, 0, b"never ends"))
            segment = receiver._segments[1].id
            await loop.sock_sendall(sock, wire.OP.pack(wire.BEGIN, len(encoded), 1, segment) + encoded)
        notice = await asyncio.wait_for(receiver.next_notice(), 10)
        assert notice.header == chunk and isinstance(notice.error, PeerDisconnected), repr(notice.error)


_RECEIVER = """
import asyncio, sys, structlog
from pdflow import transports
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
async def main():
    receiver = transports.create("shm")
    await receiver.start()
    receiver.allocate(1, 1 << 20)
    print(receiver.address, flush=True)
    while True:
        await receiver.next_notice()
asyncio.run(main())
"""


@needs_shm
async def test_shm_receiver_killed_frees_its_memory() -> None:
    """Another process's receiver: written in place through our mapping; SIGKILLed, its memory is
    unmapped here at once (no write needed to notice) and nothing is left in /dev/shm."""
    in_dev_shm = set(os.listdir("/dev/shm"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _RECEIVER, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        address = (await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip()
        async with transports.create("shm") as sender:
            data = random.randbytes(1 << 20)
            await asyncio.wait_for(sender.write(address, header(1, 0, data), data), 20)
            assert len(_kv_mappings()) == 1
            child.kill()
            await asyncio.wait_for(child.wait(), 10)
            for _ in range(500):
                if not _kv_mappings():
                    break
                await asyncio.sleep(0.01)
            assert _kv_mappings() == [], "the dead receiver's segment is still mapped"
            with pytest.raises((PeerDisconnected, PeerUnreachable)):
                await asyncio.wait_for(sender.write(address, header(1, 0, data), data), 20)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert set(os.listdir("/dev/shm")) == in_dev_shm
