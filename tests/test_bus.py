"""The control plane: messages cross real ZeroMQ sockets, every frame carries the protocol version,
and a peer of another version is refused (never decoded as ours) and reported to the launcher."""

from __future__ import annotations

import asyncio

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdflow.config.topology import parse_topology
from pdflow.messages import ALL_MESSAGES, PROTOCOL_VERSION, Cancel, Hello, ProtocolRefused
from pdflow.runtime.bus import VERSION, ZmqBus, launcher_framing, make_socket
from pdflow.runtime.memory_bus import MemoryHub
from pdflow.testing.server import free_port_base, topology_text


def _topology(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(topology_text(free_port_base()))
    return parse_topology(path.read_text(), path)


def _frame(version: int, message) -> bytes:
    return VERSION.pack(version) + msgspec.msgpack.encode(message)


async def test_messages_reach_a_peer_and_a_foreign_protocol_is_refused(tmp_path):
    topology = _topology(tmp_path)
    launcher = make_socket(zmq.asyncio.Context.instance(), zmq.PULL, bind=topology.control.pull_address)
    decode = ZmqBus(topology, "decode", 0)
    ingress = ZmqBus(topology, "ingress", 0)
    decode.start()
    ingress.start()
    try:
        await ingress.send("decode", 0, Cancel("r-1", "test"))
        assert await asyncio.wait_for(decode.recv(), 5) == Cancel("r-1", "test")  # the Hello was consumed

        ctx = zmq.asyncio.Context.instance()
        stranger = make_socket(ctx, zmq.PUSH, connect=topology.stages["decode"].control_address(0))
        other = PROTOCOL_VERSION + 1
        received: list = []

        async def collect() -> None:
            while True:
                received.append(await decode.recv())

        with structlog.testing.capture_logs() as logs:
            reader = asyncio.ensure_future(collect())
            await stranger.send(_frame(other, Hello(other, "prefill", 3, 4242)))
            await stranger.send(_frame(other, Cancel("r-2")))  # refused: not delivered
            await stranger.send(VERSION.pack(PROTOCOL_VERSION) + b"\xc1")  # malformed: skipped
            # the launcher hears of it, once per peer
            report = launcher_framing().decode(await asyncio.wait_for(launcher.recv(), 5))
            await ingress.send("decode", 0, Cancel("r-3"))
            while not received:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the stranger's last frame may be read after r-3
            reader.cancel()
        stranger.close()
        assert received == [Cancel("r-3")]
        assert isinstance(report, ProtocolRefused) and (report.stage, report.replica) == ("decode", 0)
        assert "prefill-3" in report.error
        mismatch = [entry for entry in logs if entry["event"] == "protocol.mismatch"]
        assert mismatch and "prefill-3" in mismatch[0]["error"]
        assert f"protocol {other}" in mismatch[0]["error"] and f"speaks {PROTOCOL_VERSION}" in mismatch[0]["error"]
        assert any(entry["event"] == "bus.message.malformed" for entry in logs)
    finally:
        decode.close()
        ingress.close()
        launcher.close()


async def test_memory_hub_carries_messages_between_buses():
    hub = MemoryHub({"decode": 2, "ingress": 1}, ALL_MESSAGES)
    ingress, decode1 = hub.bus("ingress"), hub.bus("decode", 1)
    await ingress.send("decode", 1, Cancel("r-1"))
    assert await asyncio.wait_for(decode1.recv(), 1) == Cancel("r-1")
    await ingress.broadcast("decode", Cancel("r-2"))
    assert await asyncio.wait_for(decode1.recv(), 1) == Cancel("r-2")
    assert hub.inbox("decode", 0).qsize() == 1


async def test_launcher_fails_fast_naming_the_stage_and_both_versions(tmp_path):
    from pdflow.messages import Ready
    from pdflow.runtime.launcher import Launcher

    launcher = Launcher(_topology(tmp_path), tmp_path)
    await launcher._handle(Ready("decode", 0, 4242, PROTOCOL_VERSION + 1))
    assert launcher.stop_requested.is_set() and not launcher.replicas[("decode", 0)].ready
    assert f"decode-0 speaks pdflow protocol {PROTOCOL_VERSION + 1}" in launcher.fatal
    assert f"the launcher speaks {PROTOCOL_VERSION}" in launcher.fatal

    # a Ready framed by another version is not decoded as ours, yet the sender is named
    older = Launcher(_topology(tmp_path), tmp_path)
    older._foreign(_frame(PROTOCOL_VERSION - 1, Ready("prefill", 1, 7, PROTOCOL_VERSION - 1)))
    assert older.stop_requested.is_set()
    assert f"prefill-1 (pid 7) speaks pdflow protocol {PROTOCOL_VERSION - 1}" in older.fatal
