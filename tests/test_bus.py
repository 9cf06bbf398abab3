"""The control plane: messages cross real ZeroMQ sockets, and a peer's protocol version is checked."""

from __future__ import annotations

import asyncio

import structlog
import zmq
import zmq.asyncio

from pdflow.runtime.bus import Bus, make_socket
from pdflow.messages import PROTOCOL_VERSION, Cancel, Hello, encoder
from pdflow.config.topology import parse_topology
from pdflow.testing.server import free_port_base, topology_text


def _topology(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(topology_text(free_port_base()))
    return parse_topology(path.read_text(), path)


async def test_messages_reach_a_peer_and_hello_is_checked(tmp_path):
    topology = _topology(tmp_path)
    decode = Bus(topology, "decode", 0)
    ingress = Bus(topology, "ingress", 0)
    decode.start()
    ingress.start()
    try:
        await ingress.send("decode", 0, Cancel("r-1", "test"))
        assert await asyncio.wait_for(decode.recv(), 5) == Cancel("r-1", "test")  # the Hello was consumed

        ctx = zmq.asyncio.Context.instance()
        stranger = make_socket(ctx, zmq.PUSH, connect=topology.stages["decode"].control_address(0))
        with structlog.testing.capture_logs() as logs:
            await stranger.send(encoder().encode(Hello(PROTOCOL_VERSION + 1, "prefill", 3, 4242)))
            await stranger.send(encoder().encode(Cancel("r-2")))
            assert await asyncio.wait_for(decode.recv(), 5) == Cancel("r-2")
        stranger.close()
        mismatch = [entry for entry in logs if entry["event"] == "protocol.mismatch"]
        assert mismatch and "prefill-3" in mismatch[0]["error"]
        assert f"protocol {PROTOCOL_VERSION + 1}" in mismatch[0]["error"]
    finally:
        decode.close()
        ingress.close()
