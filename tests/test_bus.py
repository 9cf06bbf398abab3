"""The control plane: messages cross real ZeroMQ sockets, every frame carries the protocol version,
and a peer of another version is refused (never decoded as ours) and reported to the launcher."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdflow.config.topology import parse_topology
from pdflow.messages import ALL_MESSAGES, PROTOCOL_VERSION, Cancel, Hello, ProtocolRefused
from pdflow.runtime.bus import VERSION, ZmqBus, client_security, launcher_framing, make_socket
from pdflow.runtime.memory_bus import MemoryHub
from pdflow.security.keys import PipelineKeys, new_secret
from pdflow.testing.server import free_port_base, topology_text


def _topology(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(topology_text(free_port_base()))
    return parse_topology(path.read_text(), path)


def _launcher(tmp_path):
    from pdflow.runtime.launcher import Launcher

    topology = _topology(tmp_path)
    return Launcher(topology, tmp_path, keys=PipelineKeys(new_secret(), topology.replicas()))


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

    launcher = _launcher(tmp_path)
    await launcher._handle(Ready("decode", 0, 4242, PROTOCOL_VERSION + 1))
    assert launcher.stop_requested.is_set() and not launcher.replicas[("decode", 0)].ready
    assert f"decode-0 speaks pdflow protocol {PROTOCOL_VERSION + 1}" in launcher.fatal
    assert f"the launcher speaks {PROTOCOL_VERSION}" in launcher.fatal

    # a Ready framed by another version is not decoded as ours, yet the sender is named...
    older = _launcher(tmp_path)
    older._foreign(_frame(PROTOCOL_VERSION - 1, Ready("prefill", 0, 7, PROTOCOL_VERSION - 1)), ("prefill", 0))
    assert older.stop_requested.is_set()
    assert f"prefill-0 (pid 7) speaks pdflow protocol {PROTOCOL_VERSION - 1}" in older.fatal

    # ...but junk of another version, or a Ready sent in another replica's name, stops nothing
    calm = _launcher(tmp_path)
    calm._foreign(VERSION.pack(PROTOCOL_VERSION + 7) + os.urandom(32), ("kv_shuttle", 0))
    calm._foreign(_frame(PROTOCOL_VERSION - 1, Ready("prefill", 0, 7, PROTOCOL_VERSION - 1)), ("kv_shuttle", 0))
    assert not calm.stop_requested.is_set() and calm.fatal is None
    assert (calm.malformed.count, calm.forged.count) == (1, 1)


async def _no_message(bus, seconds: float = 0.5) -> bool:
    try:
        await asyncio.wait_for(bus.recv_from(), seconds)
    except asyncio.TimeoutError:
        return True
    return False


async def test_curve_names_each_sender_and_refuses_any_other_key(tmp_path):
    """With the pipeline's keys, a receiver learns which replica sent each message (as the handshake
    proved it); a peer without a key of the pipeline, or with none at all, never gets a byte in."""
    topology = _topology(tmp_path)
    keys = PipelineKeys(new_secret(), topology.replicas())
    decode = ZmqBus(topology, "decode", 0, keys=keys.for_replica("decode", 0))
    shuttle = ZmqBus(topology, "kv_shuttle", 0, keys=keys.for_replica("kv_shuttle", 0))
    outsider = PipelineKeys(new_secret(), topology.replicas()).for_replica("kv_shuttle", 0)
    knows_publics = dataclasses.replace(keys.for_replica("kv_shuttle", 0), own=outsider.own)
    strangers = [ZmqBus(topology, "kv_shuttle", 0, keys=outsider),  # another pipeline's keys
                 ZmqBus(topology, "kv_shuttle", 0, keys=knows_publics),  # our public keys, its own pair
                 ZmqBus(topology, "kv_shuttle", 0)]  # no CURVE at all
    decode.start()
    try:
        await shuttle.send("decode", 0, Cancel("r-1", "test"))
        assert await asyncio.wait_for(decode.recv_from(), 5) == (("kv_shuttle", 0), Cancel("r-1", "test"))
        for stranger in strangers:
            await stranger.send("decode", 0, Cancel("r-2", "forged"))
        assert await _no_message(decode, 1.0)
        assert decode.counters()["control_refused_peers"] >= 1
    finally:
        for bus in (decode, shuttle, *strangers):
            bus.close()


async def test_junk_frames_are_dropped_and_counted_and_the_loop_goes_on(tmp_path):
    topology = _topology(tmp_path)
    keys = PipelineKeys(new_secret(), topology.replicas())
    decode = ZmqBus(topology, "decode", 0, keys=keys.for_replica("decode", 0))
    decode.start()
    ctx = zmq.asyncio.Context()
    push = make_socket(ctx, zmq.PUSH, connect=topology.stages["decode"].control_address(0),
                       secure=client_security(keys.for_replica("kv_shuttle", 0), "decode/0"))
    try:
        junk = [b"", b"\x00", VERSION.pack(PROTOCOL_VERSION) + os.urandom(64), os.urandom(1024),
                VERSION.pack(PROTOCOL_VERSION) + msgspec.msgpack.encode(["Cancel", 1, 2, 3]),
                VERSION.pack(PROTOCOL_VERSION) + msgspec.msgpack.encode({"not": "a message"})]
        for frame in junk:
            await push.send(frame)
        await push.send(VERSION.pack(PROTOCOL_VERSION) + msgspec.msgpack.encode(Cancel("r-ok", "after the junk")))
        sender, message = await asyncio.wait_for(decode.recv_from(), 5)
        assert (sender, message) == (("kv_shuttle", 0), Cancel("r-ok", "after the junk"))
        assert decode.counters()["control_malformed"] == len(junk)
    finally:
        push.close(0)
        ctx.destroy(0)
        decode.close()


async def test_the_launcher_takes_a_replica_s_message_only_from_that_replica(tmp_path):
    from pdflow.messages import Heartbeat
    from pdflow.runtime.bus import server_security
    from pdflow.security.curve import PipelineAuthenticator

    launcher = _launcher(tmp_path)
    topology, keys = launcher.topology, launcher.keys
    ctx = zmq.asyncio.Context()
    launcher.pull = make_socket(ctx, zmq.PULL, bind=topology.control.pull_address,
                                secure=server_security(keys.launcher()))
    auth = PipelineAuthenticator(ctx, keys.launcher())
    auth.start()
    push = make_socket(ctx, zmq.PUSH, connect=topology.control.pull_address,
                       secure=client_security(keys.for_replica("kv_shuttle", 0), "launcher"))
    try:
        framing = launcher_framing()
        await push.send(framing.encode(Heartbeat("decode", 0, 1, in_flight=99)))  # kv-shuttle posing as decode
        await push.send(framing.encode(Heartbeat("kv_shuttle", 0, 1, in_flight=7)))
        await launcher._drain_inbox(2.0)
        assert launcher.replicas[("decode", 0)].in_flight == 0
        assert launcher.replicas[("kv_shuttle", 0)].in_flight == 7
        assert launcher.forged.count == 1
    finally:
        push.close(0)
        auth.stop()
        ctx.destroy(0)
