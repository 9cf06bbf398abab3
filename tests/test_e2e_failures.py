"""End to end, when things go wrong: a stage killed mid-stream, stages killed and frozen under
load, one of two front doors (ingress replicas) killed under streams, and SIGTERM to the launcher.

The tests share one `pdflow run`; the SIGTERM test stops it, so it comes last. The fault tests
are bounded for CI; experiments/reliability.py runs them at length.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from pdflow.testing import faults
from pdflow.testing.local_http import openai_client
from pdflow.testing.server import FRONT_DOOR_PORTS, PdflowServer, front_doors_topology, held

pytestmark = pytest.mark.e2e

STORY = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def stream_id(ids: set[str]) -> str:
    (only,) = ids
    return only


POOL_BLOCKS = 5  # decode's pool here: 5 blocks of 64 tokens
HEARTBEAT_TIMEOUT_S = 5  # a frozen stage is killed this long after its last heartbeat
SECOND_DOOR = 1  # ingress replica 1 serves the API on server.port + 1


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """This module's own `pdflow run`, logging JSON, with a small pool of KV blocks in decode."""
    from transformers import AutoConfig

    from pdflow.kv.layout import KvLayout

    kv = KvLayout.from_config(AutoConfig.from_pretrained(model_dir))
    pool_bytes = POOL_BLOCKS * 2 * kv.num_layers * kv.block_bytes(64)
    topology = lambda base: front_doors_topology(base, 2, kv={"decode_pool_bytes": pool_bytes},  # noqa: E731
                                                 heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    with PdflowServer(tmp_path_factory.mktemp("pdflow-failures"), log_format="json", topology=topology,
                      ports=FRONT_DOOR_PORTS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=60)


MIGRATED_TOKENS = 32


def test_requests_wait_for_decode_s_pool_blocks_and_one_that_can_never_fit_fails_clearly(client, server):
    """Four requests that need 2 of the pool's 5 blocks each (prompt + max_tokens, 65-128
    tokens): two decode at a time, the others wait for blocks, and each answers as it does
    alone; a request whose max_tokens needs more blocks than the pool has fails at once with an
    error naming the setting."""
    questions = ["Name three primary colors.", "What is 12 times 12?", "Describe a cat in five words.",
                 "What language is spoken in Brazil?"]
    kwargs = dict(model="smollm2", temperature=0, max_tokens=60, extra_body={"ignore_eos": True})

    def ask(question):
        return client.chat.completions.create(messages=[{"role": "user", "content": question}], **kwargs)

    alone = {q: ask(q).choices[0].message.content for q in questions}
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda q=q: results.__setitem__(q, ask(q).choices[0].message.content))
               for q in questions]
    for thread in threads:
        thread.start()
    waited = 0
    while any(thread.is_alive() for thread in threads):
        stats = server.health()["stages"]["decode-0"]["stats"]
        waited = max(waited, stats["awaiting_pool_blocks"])
        time.sleep(0.05)
    assert results == alone
    assert waited >= 1  # some did wait for blocks
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(messages=FRANCE, model="smollm2", max_tokens=400)
    assert "kv.decode_pool_bytes" in str(error.value) and error.value.status_code == 503
    stats = faults.settled(server)["stages"]["decode-0"]["stats"]
    assert stats["pool_blocks"] == POOL_BLOCKS and stats["pool_free_blocks"] == POOL_BLOCKS


def test_killing_decode_mid_stream_migrates_the_request_and_its_stream_goes_on_whole(client, server):
    """decode dies after a few tokens; the request is re-prefilled (prompt and the tokens already
    sent) on the restarted decode and the client's one stream goes on: the same text as an
    uninterrupted run, every token counted once."""
    kwargs = dict(model="smollm2", messages=STORY, temperature=0, max_tokens=MIGRATED_TOKENS,
                  extra_body={"ignore_eos": True})
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    old_pid = server.stage_pids()["decode-0"]
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, ids, finish, usage, killed_at = [], set(), None, None, None
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if len(pieces) == 6 and killed_at is None:
            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()
    assert killed_at is not None, "the stream ended before decode could be killed"
    assert "".join(pieces) == expected
    assert finish == "length" and usage.completion_tokens == MIGRATED_TOKENS and len(ids) == 1

    assert server.wait_healthy(120), server.log()
    assert server.stage_pids()["decode-0"] != old_pid
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content
    events = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    died = [e for e in events if e["event"] == "stage.died"]
    assert died and died[0]["stage"] == "decode-0" and died[0]["reason"] == "killed by SIGKILL"
    migrated = [e for e in events if e["event"] == "request.migrated"]
    assert len(migrated) == 1 and migrated[0]["request_id"] == stream_id(ids) and migrated[0]["generated"] > 0
    deadline = time.monotonic() + 5  # /health shows ingress's counters as of its last heartbeat (<= ~1.5 s old)
    while server.health()["stages"]["ingress-0"]["stats"]["migrations"] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.health()["stages"]["ingress-0"]["stats"]["migrations"] == 1
    # the store let go of the killed request's blocks (and of the one after it)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.health()["stages"]["kv-shuttle-0"]["stats"]
        if not stats["leases"] and not stats["leased_blocks"]:
            break
        time.sleep(0.5)
    assert stats["leases"] == 0 and stats["leased_blocks"] == 0, held(stats)


def test_stages_killed_and_frozen_under_load_lose_no_request_and_leave_nothing_behind(server):
    """kill -9 of kv-shuttle, then SIGSTOP of prefill past the heartbeat deadline (the launcher
    kills it), under three streaming clients with random aborts: every request ends whole or with
    a clear error within the bound, and afterwards nothing is in flight, no lease is held, no old
    process or shared-memory segment is left, and the stages that lived through it hold no more
    threads or file descriptors than before."""
    faults.settled(server)
    shm_before = faults.shm_segments()
    survivors = {name: f for name, f in faults.footprint(server).items() if name not in ("kv-shuttle-0", "prefill-0")}
    load = faults.Load(server.url, clients=3, abort_ratio=0.2, max_tokens=12, bound_s=40).start()
    old = []
    try:
        time.sleep(2)
        old.append(faults.kill9(server, "kv-shuttle-0"))
        assert faults.wait_replaced(server, "kv-shuttle-0", old[-1], 120) is not None, server.log()
        time.sleep(1)
        old.append(faults.freeze(server, "prefill-0", HEARTBEAT_TIMEOUT_S + 2))
        assert faults.wait_replaced(server, "prefill-0", old[-1], 120) is not None, server.log()
        time.sleep(2)
    finally:
        outcomes = load.stop()
    counts = load.counts()
    lost = [o for o in outcomes if o.kind == "lost"]
    assert not lost, lost[:3]
    migrations = server.health()["stages"]["ingress-0"]["stats"]["migrations"]
    assert counts["ok"] > 0 and counts["error"] + migrations > 0, counts  # the faults did reach requests
    assert all(o.seconds < 40 for o in outcomes)
    faults.settled(server)
    faults.none_left_behind(old, shm_before)
    after = faults.footprint(server)
    for name, was in survivors.items():  # the stages that lived through it kept no thread or socket
        assert after[name]["threads"] <= was["threads"] + 2 and after[name]["fds"] <= was["fds"] + 8, \
            (name, was, after[name])
    restarts = {name: info["restarts"] for name, info in server.health()["stages"].items()}
    assert restarts["kv-shuttle-0"] >= 1 and restarts["prefill-0"] >= 1, restarts


def test_killing_one_of_two_front_doors_loses_none_of_the_other_s_streams(server):
    """Two ingress replicas behind a round robin (the client's): streams on both, then kill -9 of
    one. Every stream on the other completes; a new request on it succeeds at once, with no wait
    for anything to notice; the dead one's streams, retried on the next door of the round robin,
    complete too; the stages drop what they held for its requests; its host's launcher brings it
    back, and it serves again."""
    doors = [server.url, f"http://127.0.0.1:{server.base + SECOND_DOOR}"]
    turn = iter(range(1_000_000))

    def front_door() -> str:  # a simple round robin in front of them
        return doors[next(turn) % len(doors)]

    faults.settled(server)
    results: dict[int, dict] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        door = front_door()
        results[i] = {"door": door, "text": "", "tries": 0}
        for _ in range(len(doors)):  # a request whose door died is retried on the next one
            results[i]["tries"] += 1
            client = openai_client(door, timeout=60)
            try:
                text, first = "", True
                for chunk in client.chat.completions.create(model="smollm2", messages=STORY, temperature=0,
                                                            max_tokens=48, stream=True):
                    if first and results[i]["tries"] == 1:
                        first = False
                        started.wait(60)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        results[i]["finish"] = chunk.choices[0].finish_reason
                    text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                results[i].update(text=text, served_by=door)
                return
            except openai.APIError as exc:
                results[i].setdefault("errors", []).append(f"{door}: {exc}")
                door = doors[(doors.index(door) + 1) % len(doors)]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(60)  # every stream has its first token
    old = faults.kill9(server, "ingress-1")
    client = openai_client(doors[0], timeout=60)
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"  # the survivor took it at once
    for thread in threads:
        thread.join(120)
    on_survivor = [r for r in results.values() if r["door"] == doors[0]]
    on_killed = [r for r in results.values() if r["door"] == doors[1]]
    assert len(on_survivor) == len(on_killed) == 2, results
    assert all(r["tries"] == 1 and r.get("finish") == "length" for r in on_survivor), on_survivor
    assert all(r["tries"] == 2 and r.get("served_by") == doors[0] and r.get("finish") == "length"
               for r in on_killed), on_killed  # retried on the next door: whole there
    assert all(r["text"] for r in results.values())
    assert faults.wait_replaced(server, "ingress-1", old, 120) is not None, server.log()
    faults.settled(server)  # what the stages held for the dead door's requests is gone
    assert "requests.orphaned" in server.log()
    again = openai_client(doors[1], timeout=60)
    assert again.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                         max_tokens=4).choices[0].finish_reason == "length"


def test_sigterm_stops_the_whole_tree_within_10_s(client, server):
    pids = list(server.stage_pids().values())
    assert len(pids) == 5 and all(faults.alive(pid) for pid in pids)
    outcome = {}

    def in_flight_request():
        try:
            reply = client.chat.completions.create(model="smollm2", messages=STORY, temperature=0, max_tokens=40)
            outcome["finished"] = reply.choices[0].finish_reason
        except openai.APIError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=in_flight_request)
    worker.start()
    time.sleep(1.0)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(15)
    elapsed = time.monotonic() - started
    worker.join(15)
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert server.proc.returncode == 0
    assert not [pid for pid in pids if faults.alive(pid)], "stage processes outlived the launcher"
    assert not worker.is_alive() and outcome, "the in-flight request hung"


def test_every_line_of_that_whole_run_s_json_log_is_json(server):
    """The run above logged JSON (--log-format json) through stages killed, frozen, restarted and a
    SIGTERM: every line it wrote, the standard library's loggers (uvicorn, the kernels' loader, the
    packed cache, ZeroMQ's authenticator) and the launcher's status included, is one JSON object."""
    assert server.proc.poll() is not None  # (stopped by the test above: the log is whole)
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    assert len(lines) > 50
    bad = []
    for line in lines:
        try:
            event = json.loads(line)
            assert isinstance(event, dict) and "event" in event and "level" in event
        except (ValueError, AssertionError):
            bad.append(line[:200])
    assert not bad, f"{len(bad)} of {len(lines)} lines are not JSON log events, e.g.:\n" + "\n".join(bad[:5])
    events = [json.loads(line) for line in lines]
    assert any(e["event"] == "pipeline.status" and e.get("headline") == "ready" for e in events)
    assert {e.get("stage") for e in events} >= {"launcher", "ingress", "prefill", "kv-shuttle", "decode"}


def test_kill_9_of_the_launcher_takes_every_stage_and_the_fork_server_with_it(tmp_path):
    """Stages are forked by a fork server that outlives the launcher while any of them lives:
    each stage watches the launcher itself, so none is orphaned, and the fork server goes too."""
    with PdflowServer(tmp_path, mode="colocated") as running:
        pids = list(running.stage_pids().values())
        launcher = running.proc.pid
        children = [int(p) for p in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]
        os.kill(launcher, signal.SIGKILL)
        running.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(faults.alive(pid) for pid in pids + children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 2 and not [pid for pid in pids if faults.alive(pid)], "stages outlived the launcher"
        assert not [pid for pid in children if faults.alive(pid)], "the fork server outlived the launcher"
