"""Prefix reuse end to end: multi-turn chat and questions over one document give the same greedy
answers with the KV store as without it, alone and 16 at a time, report cached tokens the OpenAI
way, and leave no lease behind (stats read from /health)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

DOCUMENT = (Path(__file__).parent / "data" / "rag_document.txt").read_text()
QUESTIONS = ["Which tributary is dammed, and where?", "When may canoes use the river above Kettle Bridge?",
             "What was the record salmon year?"]
SESSIONS = [
    ["I am planning a week of walking along a river valley in late autumn, staying in small towns, carrying "
     "my own food and a light tent, and I would like to see birds, old bridges and a mill or two on the way. "
     "Tell me about rivers in one sentence.", "Name one fish that lives in rivers.", "Why do rivers flood?"],
    [f"Read this and say what it describes in five words.\n\n{DOCUMENT}", "Name the towns.", "Which is oldest?"],
]
MAX_TOKENS = 24
BLOCK = 64  # the default kv.block_tokens


def _chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int, int]:
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    usage = reply.usage
    return reply.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def _workload(client: openai.OpenAI) -> list[tuple[list[dict], str, int, int]]:
    """Every conversation turn (each sending the history with the model's own answers) and every
    question about the document, one after another: (messages, answer, prompt tokens, cached)."""
    done = []
    for session in SESSIONS:
        history: list[dict] = []
        for message in session:
            history = history + [{"role": "user", "content": message}]
            answer, prompt, cached = _chat(client, history)
            done.append((history, answer, prompt, cached))
            history = history + [{"role": "assistant", "content": answer}]
    for question in QUESTIONS:
        messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]
        done.append((messages, *_chat(client, messages)))
    return done


def _store_stats(url: str, stage: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["stages"][stage].get("stats", {})


def _settled_stats(url: str, stage: str) -> dict:
    """The store's stats once every request's answer is in and its leases are gone (a few
    heartbeats: they travel with them)."""
    deadline = time.monotonic() + 15
    stats = _store_stats(url, stage)
    while time.monotonic() < deadline and (stats.get("leases") or stats.get("pinned_blocks")):
        time.sleep(0.5)
        stats = _store_stats(url, stage)
    time.sleep(1.2)  # one more heartbeat after the last change
    return _store_stats(url, stage)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    """The answers without reuse (prefix_cache = false)."""
    with PdflowServer(tmp_path_factory.mktemp("no-reuse"), kv={"prefix_cache": False}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = _workload(client)
        assert all(cached == 0 for *_, cached in done)
        stats = _settled_stats(server.url, "kv-shuttle-0")
        assert stats["lookups"] == 0 and stats["blocks_cached"] == 0 and stats["leases"] == 0
        return done


DEPLOYMENTS = {"disaggregated": ({}, "kv-shuttle-0"),
               "colocated": ({"mode": "colocated", "chunked_prefill_tokens": 64}, "worker-0")}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def reusing(request, tmp_path_factory, model_dir):
    options, stage = DEPLOYMENTS[request.param]
    with PdflowServer(tmp_path_factory.mktemp(request.param), **options) as server:
        server.store_stage = stage
        yield server


def test_reuse_gives_the_same_answers_and_reports_cached_tokens(reusing, reference):
    client = openai.OpenAI(base_url=f"{reusing.url}/v1", api_key="unused", max_retries=0, timeout=120)
    done = _workload(client)
    for (messages, answer, prompt, cached), (ref_messages, ref_answer, ref_prompt, _) in zip(done, reference):
        assert messages == ref_messages and prompt == ref_prompt
        assert answer == ref_answer, f"turn {messages[-1]['content'][:40]!r}: {answer!r} != {ref_answer!r}"
        assert cached % BLOCK == 0 and cached < prompt
    by_turn = [cached for _, _, _, cached in done]
    # later turns of a session hit the earlier turns' prompts and answers
    assert by_turn[0] == 0 and by_turn[1] > 0 and by_turn[2] > by_turn[1]
    assert by_turn[4] > 0 and by_turn[5] > by_turn[4]
    # later questions about the document hit all of it but the last partial block and the question
    for _, _, prompt, cached in done[7:]:
        assert cached >= prompt - 40 - BLOCK, (prompt, cached)
    stats = _settled_stats(reusing.url, reusing.store_stage)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats
    assert stats["hits"] >= 6 and stats["hit_tokens"] >= sum(by_turn), stats
    assert stats["checksum_failures"] == 0


def test_sixteen_at_once_give_the_same_answers(reusing, reference):
    client = openai.OpenAI(base_url=f"{reusing.url}/v1", api_key="unused", max_retries=0, timeout=300)
    jobs = [reference[i % len(reference)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: _chat(client, job[0]), jobs))
    for (answer, prompt, cached), (messages, ref_answer, ref_prompt, _) in zip(answers, jobs):
        assert prompt == ref_prompt
        assert answer == ref_answer, f"{messages[-1]['content'][:40]!r}: {answer!r} != {ref_answer!r}"
    assert sum(cached for _, _, cached in answers) > 0
    stats = _settled_stats(reusing.url, reusing.store_stage)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats


def test_a_client_gone_mid_answer_leaves_no_lease(reusing):
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Describe every town at length."}]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{reusing.url}/v1/chat/completions",
                         json={"model": "smollm2", "messages": messages, "max_tokens": 200, "stream": True,
                               "temperature": 0}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # one token in: hang up
    stats = _settled_stats(reusing.url, reusing.store_stage)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats
