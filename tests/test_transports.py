"""The transport registry, and the conformance suite for every transport usable here."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
import uvloop

from pdflow import transports
from pdflow.testing.transport_conformance import CHECKS, Unsupported, harness_for, header, run_all
from pdflow.transports import IncompatiblePeer, PeerUnreachable

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


def test_tcp_conformance_under_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        skipped = runner.run(asyncio.wait_for(run_all(harness_for("tcp")), 4 * CHECK_TIMEOUT_S))
    assert skipped == []


# --- registry ------------------------------------------------------------------------------


def test_builtin_names_and_availability() -> None:
    assert transports.names()[:5] == ["tcp", "inproc", "shm", "ucx", "verbs"]
    assert transports.availability("tcp") is None and transports.availability("inproc") is None
    assert type(transports.create("inproc")).__name__ == "InProcTransport"
    tcp = transports.create("tcp", "127.0.0.1", 0, timeout_s=1.0)
    assert tcp.name == "tcp" and tcp.timeout_s == 1.0


def test_unavailable_transports_say_how_to_install() -> None:
    assert "pip install 'pdflow[ucx]'" in transports.availability("ucx")
    assert "python3-pyverbs" in transports.availability("verbs")
    assert "later release" in transports.availability("shm")
    with pytest.raises(ImportError, match=r"pdflow\[ucx\]"):
        transports.load("ucx")


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
    monkeypatch.setattr(transports, "_entry_points", lambda: plugins)
    transports._resolve.cache_clear()
    try:
        assert transports.names()[-2:] == ["plugin", "broken"]
        assert transports.load("plugin").name == "inproc"
        assert "failed to load" in transports.availability("broken")
    finally:
        transports._resolve.cache_clear()


def test_unknown_options_are_rejected() -> None:
    with pytest.raises(TypeError, match="timeout"):
        transports.create("tcp", timeuot_s=3)


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


async def test_tcp_writes_queued_behind_a_failed_connect_fail_fast() -> None:
    """A peer that accepts but never answers: one connect timeout, not one per queued write."""
    silent = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    async with transports.create("tcp", timeout_s=0.5) as sender:
        loop = asyncio.get_running_loop()
        started = loop.time()
        writes = [sender.write(address, header(1, 0, b"x"), b"x") for _ in range(20)]
        outcomes = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 10)
        assert all(isinstance(o, PeerUnreachable) for o in outcomes), outcomes
        assert loop.time() - started < 3
    silent.close()


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
