"""The control plane under attack, against the session's shared server (real processes):

- outsiders (no key, or a key of their own with our public keys) reach no stage and not the
  launcher: CURVE refuses them before any of their bytes are decoded;
- an insider (a key of the pipeline, here kv-shuttle's) that sends junk, mutated, oversized or
  wrongly typed frames to every stage and the launcher crashes, restarts and stalls nothing;
- forged messages about another client's request (a Cancel, a TextDelta, a Tokens from a stage
  that may not send it) are dropped and counted, and the victim's stream ends whole.

Bounded for CI (``PDFLOW_FUZZ_EXAMPLES``, default 20 per target); at length with e.g.
``PDFLOW_FUZZ_EXAMPLES=2000 scripts/test.sh tests/test_hostile_control.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdflow.messages import (
    ALL_MESSAGES,
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    KvFetch,
    KvHoldings,
    PrefillRequest,
    Route,
    SamplingParams,
    TextDelta,
    Tokens,
)
from pdflow.runtime.bus import VERSION, Framing, client_security, launcher_framing
from pdflow.security.keys import PipelineKeys, new_secret
from pdflow.testing.local_http import local_http

pytestmark = pytest.mark.e2e

FUZZ_EXAMPLES = int(os.environ.get("PDFLOW_FUZZ_EXAMPLES", "20"))
OURS = VERSION.pack(PROTOCOL_VERSION)


def _targets(server) -> dict[str, tuple[str, str]]:
    """name -> (control address, identity of its owner) for every stage replica and the launcher."""
    pipeline = server.pipeline()
    targets = {f"{name}/{i}": (stage.control_address(i), f"{name}/{i}")
               for name, stage in pipeline.stages.items() for i in range(stage.replicas)}
    targets["launcher"] = (pipeline.control.pull_address, "launcher")
    return targets


def _restarts(server) -> dict[str, int]:
    return {name: info["restarts"] for name, info in server.health()["stages"].items()}


def _stats(server) -> dict[str, dict]:
    return {name: info.get("stats", {}) for name, info in server.health()["stages"].items()}


def _counter(server, name: str) -> int:
    return sum(stats.get(name, 0) for stats in _stats(server).values())


def _settle(server, counter: str, above: int, timeout_s: float = 5.0) -> int:
    """``counter`` summed over the stages once it exceeds ``above`` (heartbeats carry it)."""
    deadline = time.monotonic() + timeout_s
    value = _counter(server, counter)
    while value <= above and time.monotonic() < deadline:
        time.sleep(0.2)
        value = _counter(server, counter)
    return value


def _ask(server, max_tokens: int = 4) -> httpx.Response:
    return local_http().post(f"{server.url}/v1/completions", timeout=60,
                             json={"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0})


class _Peer:
    """PUSH sockets to every target, as ``keys`` (None: no CURVE at all)."""

    def __init__(self, server, keys):
        self.ctx = zmq.Context()
        self.sockets = {}
        for name, (address, owner) in _targets(server).items():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            secure = client_security(keys, owner)
            if secure is not None:
                secure(sock)
            sock.connect(address)
            self.sockets[name] = sock

    def send(self, name: str, frame: bytes) -> None:
        try:
            self.sockets[name].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (refused) or full: the point is that nothing breaks

    def deliver(self, name: str, frame: bytes, timeout_s: float = 5.0) -> None:
        """Send once the connection is up (its CURVE handshake done): for a message that must arrive."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sockets[name].send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def close(self) -> None:
        self.ctx.destroy(0)


def test_outsiders_reach_no_stage_and_not_the_launcher(server):
    keys = server.keys()
    own_pair = PipelineKeys(new_secret(), server.pipeline().replicas()).for_replica("kv_shuttle", 0).own
    outsiders = [None, dataclasses.replace(keys.for_replica("kv_shuttle", 0), own=own_pair)]
    before_restarts, refused_before = _restarts(server), _counter(server, "control_refused_peers")
    decoded_before = _counter(server, "control_malformed") + _counter(server, "control_forged")
    forged = Framing(ALL_MESSAGES).encode(Cancel("anything", "forged by an outsider"))
    peers = [_Peer(server, k) for k in outsiders]
    try:
        for peer in peers:
            for name in peer.sockets:
                for _ in range(5):
                    peer.send(name, forged)
                    peer.send(name, os.urandom(512))
        assert _settle(server, "control_refused_peers", refused_before) > refused_before
    finally:
        for peer in peers:
            peer.close()
    fresh = server.fresh_stats().values()  # had any of their bytes been decoded, these heartbeats would count it
    assert sum(stats.get("control_malformed", 0) + stats.get("control_forged", 0) for stats in fresh) == decoded_before
    assert _restarts(server) == before_restarts and server.healthy()
    assert _ask(server).status_code == 200


_VALID = [
    Framing(ALL_MESSAGES).encode(Cancel("r-fuzz", "fuzz")),
    Framing(ALL_MESSAGES).encode(TextDelta("r-fuzz", "text", 1)),
    Framing(ALL_MESSAGES).encode(PrefillRequest("r-fuzz", [1, 2, 3], SamplingParams(), Route({"ingress": 0}))),
    launcher_framing().encode(Heartbeat("kv_shuttle", 0, 1)),
]
_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=20,
)


@st.composite
def _frames(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "ours+random", "msgpack", "mutated", "truncated", "tagged"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    if kind == "ours+random":
        return OURS + draw(st.binary(max_size=2048))
    if kind == "msgpack":
        return OURS + msgspec.msgpack.encode(draw(_msgpack_values))
    if kind == "tagged":  # a known tag with fields of the wrong types or count
        tag = draw(st.sampled_from(["Cancel", "TextDelta", "Tokens", "PrefillRequest", "KvPlan", "Heartbeat",
                                    "Hello", "DecodeRequest", "KvReleased", "NoSuchMessage"]))
        return OURS + msgspec.msgpack.encode([tag, *draw(st.lists(_msgpack_values, max_size=8))])
    frame = bytearray(draw(st.sampled_from(_VALID)))
    if kind == "truncated":
        return bytes(frame[:draw(st.integers(0, len(frame) - 1))])
    for _ in range(draw(st.integers(1, 8))):  # bit flips
        i = draw(st.integers(0, len(frame) - 1))
        frame[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(frame)


def test_an_insider_s_junk_crashes_restarts_and_stalls_nothing(server):
    keys = server.keys().for_replica("kv_shuttle", 0)
    before_restarts = _restarts(server)
    malformed_before = _counter(server, "control_malformed")
    peer = _Peer(server, keys)
    sent = 0
    slowest_health = 0.0
    try:
        for name in peer.sockets:

            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(frame=_frames())
            def fuzz(frame):
                nonlocal sent
                peer.send(name, frame)
                sent += 1

            fuzz()
            peer.send(name, OURS + b"\x00" * (17 * 2**20))  # over the largest frame: the peer is cut off
            start = time.monotonic()
            assert server.health() is not None
            slowest_health = max(slowest_health, time.monotonic() - start)
        assert _settle(server, "control_malformed", malformed_before) > malformed_before
    finally:
        peer.close()
    server.fresh_stats()  # (heartbeats sent after the last frame)
    assert _restarts(server) == before_restarts, "a stage restarted"
    assert server.healthy() and slowest_health < 2.0
    assert _ask(server).status_code == 200


def test_forged_messages_cannot_touch_another_client_s_request(server):
    """While a victim streams its answer, an insider without the right to act on it sends decode a
    Cancel (only ingress cancels) and ingress a TextDelta and Tokens (from stages whose outputs of
    that kind are not wired to it): all are dropped and counted, and the victim's stream ends whole."""
    keys = server.keys()
    forged_before = _counter(server, "control_forged")
    result: dict = {}
    started = threading.Event()

    def victim():
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "Count slowly from one to fifty:", "max_tokens": 40, "temperature": 0,
                                "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    result.setdefault("id", json.loads(line[6:])["id"])  # the id is the request's
                    started.set()
                if line.startswith("data: "):
                    lines.append(line)
        result["lines"] = lines
        started.set()

    thread = threading.Thread(target=victim)
    thread.start()
    assert started.wait(30) and "id" in result, "the victim's stream never started"
    request_id = result["id"]
    shuttle, decode = _Peer(server, keys.for_replica("kv_shuttle", 0)), _Peer(server, keys.for_replica("decode", 0))
    framing = Framing(ALL_MESSAGES)
    try:
        shuttle.deliver("decode/0", framing.encode(Cancel(request_id, "forged")))  # only ingress cancels
        decode.deliver("ingress/0", framing.encode(TextDelta(request_id, "INJECTED", 1)))  # decode sends tokens, not text
        shuttle.deliver("ingress/0", framing.encode(Tokens(request_id, 1, [1, 2, 3])))  # kv-shuttle sends no tokens
        # a store's holdings come from that store only
        decode.deliver("ingress/0", framing.encode(KvHoldings("kv_shuttle", 0, 0, True, b"\x00" * 8)))
        # and a store's prefix goes only to another replica of the store that asks for it itself
        decode.deliver("kv_shuttle/0", framing.encode(KvFetch("x:fetch", "kv_shuttle", 0, [1] * 128, 0,
                                                              "tcp://127.0.0.1:9", 0, 4, [0, 1])))
        thread.join(60)
    finally:
        shuttle.close()
        decode.close()
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]" and "INJECTED" not in "".join(lines)
    assert any('"finish_reason":"length"' in line for line in lines)
    assert _settle(server, "control_forged", forged_before + 4) >= forged_before + 5

