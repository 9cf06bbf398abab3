"""The store's disk tier end to end, on one `pdflow run` whose memory tier holds 16 blocks: a
conversation pushed out of memory comes back from disk with the same greedy answer, and again after
kv-shuttle is killed with SIGKILL, read while the request queued (the queue hides the read); a
request's own TTL (0: keep nothing); forgetting a conversation or everything through the admin
endpoint; and a disk that fills up (a small tmpfs, where this runs as root), after which the
store goes on in memory and /health says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pdflow.testing.faults import kill9
from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

DOCUMENT = (Path(__file__).parent / "data" / "rag_document.txt").read_text()
HALF = DOCUMENT[: len(DOCUMENT) // 2]
TMPFS_BYTES = 160 << 20  # about 54 blocks of SmolLM2 (fp32, 64 tokens)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A small tmpfs where this runs as root (so the disk can fill up), else a plain directory."""
    path = tmp_path_factory.mktemp("kv-disk")
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
                                 capture_output=True).returncode == 0
    yield path, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, disk_dir, model_dir):
    kv = {"store_bytes": "48MiB", "disk_path": str(disk_dir[0]), "disk_capacity": "1GiB",
          "disk_segment_bytes": "8MiB"}
    with PdflowServer(tmp_path_factory.mktemp("pdflow-disk"), kv=kv) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


def _ask(client, text: str, max_tokens: int = 12, **extra) -> tuple[str, int, str]:
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                           temperature=0, max_tokens=max_tokens, extra_body=extra or None)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens, reply.id


def _stats(server) -> dict:
    return server.quiet_stats()["kv-shuttle-0"]  # (heartbeats carry them)


def _spilled(server) -> dict:
    """The store's stats once nothing is queued for disk and no lease is held (answers written back)."""
    deadline = time.monotonic() + 20
    while True:
        stats = _stats(server)
        if not (stats.get("spill_queued") or stats.get("leases")) or time.monotonic() > deadline:
            return stats


def _fill_memory(client, tag: str) -> None:
    """Three other documents of five blocks each: more than memory's 16 blocks."""
    for i in range(3):
        _ask(client, f"{tag} {i}. Summarize in three words:\n\n{DOCUMENT[len(DOCUMENT) // 2 :]}", max_tokens=2)


def test_a_conversation_pushed_out_of_memory_comes_back_from_disk_with_the_same_answer(client, server):
    question = f"Read this and say what it describes in five words.\n\n{HALF}"
    cold, cached, _ = _ask(client, question)
    assert cached == 0
    _spilled(server)  # its answer written back and its lease let go: nothing pins its blocks in memory
    _fill_memory(client, "Other document")
    before = _spilled(server)
    assert before["spilled_blocks"] >= 15 and before["evictions"] > 0 and before["disk_enabled"] == 1
    warm, cached, _ = _ask(client, question)
    after = _stats(server)
    assert warm == cold
    assert cached >= 4 * 64  # the prompt's full blocks, less the last token's
    assert after["disk_loaded_blocks"] - before["disk_loaded_blocks"] >= 4 and after["disk_load_failed"] == 0


def test_after_kill_9_of_kv_shuttle_a_queued_request_hits_its_blocks_on_disk_read_while_it_waited(client, server):
    """kv-shuttle restarts with an empty memory tier; a request queued behind another one's
    prefill finds its prefix on disk, read while it waited (its plan was there when prefill got
    to it), with the same greedy answer."""
    question = f"List two places named in this text.\n\n{HALF}"
    cold, _, _ = _ask(client, question)
    _spilled(server)
    old = kill9(server, "kv-shuttle-0")
    deadline = time.monotonic() + 120
    while server.stage_pids().get("kv-shuttle-0") in (old, None) or not server.healthy():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.25)
    long_cold = f"Unrelated essay {time.time()}. Summarize:\n\n{HALF}"  # (both fit in memory's 16 blocks)
    with ThreadPoolExecutor(2) as pool:
        ahead = pool.submit(_ask, client, long_cold, 2)
        time.sleep(0.1)  # it arrives second, and waits for prefill behind the long prompt
        warm, cached, request_id = pool.submit(_ask, client, question).result()
        ahead.result()
    assert warm == cold and cached >= 4 * 64  # memory is new: every cached token came from disk
    timeline = local_http().get(f"{server.url}/debug/timeline/{request_id}", timeout=10).json()
    waited = timeline["prefill.plan_in"][0] - timeline["prefill.dequeued"][0]
    assert waited < 0.005, f"prefill waited {waited * 1000:.1f} ms for a plan the queue should have hidden"
    # layer l attends over its prefix once that has landed, before layer l + 1's keys exist
    landed, then = timeline["prefill.prefix_in"], timeline["prefill.layer_done"][1:] + timeline["prefill.end"]
    assert len(landed) == len(then) and all(timeline["prefill.plan_in"][0] <= t <= d for t, d in zip(landed, then)), \
        (timeline["prefill.plan_in"], landed, then)
    stats = _spilled(server)
    assert stats["disk_loaded_blocks"] >= 4 and stats["disk_blocks"] > 0 and stats["leases"] == 0


def test_a_request_s_own_ttl(client, server):
    short = HALF[: len(HALF) // 2]  # two blocks and a bit
    private = f"Private note 1, do not keep. What is the first word of this?\n\n{short}"
    _ask(client, private, 1, kv_ttl_s=0)
    assert _ask(client, private, 1, kv_ttl_s=0)[1] == 0  # nothing of it was kept, in memory or on disk
    brief = f"Brief note 2. What is the last word of this?\n\n{short}"
    _ask(client, brief, 1, kv_ttl_s=2.5)
    assert _ask(client, brief, 1, kv_ttl_s=2.5)[1] > 0
    time.sleep(2.6)
    assert _ask(client, brief, 1, kv_ttl_s=2.5)[1] == 0  # expired: never served, from either tier
    with pytest.raises(openai.BadRequestError, match="kv_ttl_s"):
        _ask(client, "hello", kv_ttl_s=-1)


def test_forgetting_a_conversation_and_then_everything(client, server):
    secret = f"My diary, page 7. Summarize it:\n\n{HALF}"
    _ask(client, secret)
    assert _ask(client, secret)[1] > 0
    _spilled(server)
    url = f"{server.url}/admin/kv/forget"
    answer = local_http().post(url, json={"messages": [{"role": "user", "content": secret}]}, timeout=30)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    dropped = body["replicas"]["kv-shuttle-0"]
    assert body["unreached"] == [] and body["prefix_blocks"] >= 4
    assert dropped["memory_blocks"] >= 4 and dropped["disk_blocks"] >= 4
    assert _ask(client, secret)[1] == 0  # computed again from scratch
    _spilled(server)  # (its answer written back too)
    everything = local_http().post(url, json={"all": True}, timeout=30).json()["replicas"]["kv-shuttle-0"]
    assert everything["memory_blocks"] > 0 and everything["disk_blocks"] > 0
    deadline = time.monotonic() + 10  # (/health's stats lag a heartbeat or two)
    while (stats := _stats(server))["disk_blocks"] or stats["blocks_cached"]:
        assert time.monotonic() < deadline, stats
    for body, field in (({}, "body"), ({"all": False}, "all"), ({"all": True, "prompt": "x"}, "all"),
                        ({"prompt": 5}, "prompt")):
        refused = local_http().post(url, json=body, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_a_full_disk_turns_the_tier_off_and_the_store_goes_on_in_memory(client, server, disk_dir):
    if not disk_dir[1]:
        pytest.skip("needs root to mount a small tmpfs")
    path = disk_dir[0]
    free = shutil.disk_usage(path).free
    with open(path / "another-process.bin", "wb") as f:  # another process takes all but 4 MiB
        f.write(bytes(max(0, free - (4 << 20))))
    for i in range(4):  # each writes more than 4 MiB of blocks
        _ask(client, f"Filling the disk, part {i}. Say one word about:\n\n{HALF}", max_tokens=1)
        if not _stats(server).get("disk_enabled", 1):
            break
    health = server.health()["stages"]["kv-shuttle-0"]
    assert health["stats"]["disk_enabled"] == 0, health
    assert "No space left" in health["notes"]["disk"]
    question = f"After the disk filled. Say one word about:\n\n{HALF}"
    first, _, _ = _ask(client, question)
    again, cached, _ = _ask(client, question)
    assert again == first and cached > 0  # memory still serves
