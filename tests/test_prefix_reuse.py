"""Prefix reuse end to end: multi-turn chat and questions over one document give the same greedy
answers with the KV store as without it, alone and 16 at a time, report cached tokens the OpenAI
way, and leave no lease behind (stats read from /health).

The answers without reuse come from the engine in this process, computed as a disaggregated
pipeline without a store computes them (the whole prompt prefilled, then decoded in a batch):
tests/test_engine.py checks that this equals the model's own generate(), and test_e2e that the
pipeline's answers equal it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pdflow.testing.local_http import openai_client
from pdflow.testing.server import held
from tests.conftest import shared_server

pytestmark = pytest.mark.e2e

FIELD_GUIDE = (Path(__file__).parent / "data" / "rag_document.txt").read_text()
# Its first five paragraphs (about 430 tokens, 6 blocks), read again by most turns below: the whole
# guide (about 700) cost the reference (every prompt computed whole) twice the prefill for nothing
# more tested. The prompt that must still be computing when another arrives reads the whole guide.
DOCUMENT = FIELD_GUIDE.split("\n\nWalking the river")[0]
QUESTIONS = ["Which tributary is dammed, and where?", "Which town has a bridge of nine arches?",
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


def _settled_stats(server, stage: str) -> dict:
    """The store's stats once every request's answer is in and its leases are gone (from
    heartbeats sent after the last request ended: /health lags the stage)."""
    deadline = time.monotonic() + 15
    stats = server.fresh_stats()[stage]
    while time.monotonic() < deadline and (stats.get("leases") or stats.get("leased_blocks")):
        stats = server.fresh_stats()[stage]
    return stats


class _Engine:
    """Greedy answers from the engine in this process, without any cache: a stand-in for the
    OpenAI client in :func:`_workload` (the same ``chat.completions.create`` shape)."""

    def __init__(self, model_and_tokenizer):
        self.loaded, self.tokenizer = model_and_tokenizer
        self.chat = self.completions = self

    def create(self, model, messages, temperature, max_tokens):
        from types import SimpleNamespace

        from pdflow.engine import DecodeBatch, Sampler, Sequence, prefill
        from pdflow.messages import SamplingParams

        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        kv = {}
        sampler = Sampler(SamplingParams(max_tokens=max_tokens, temperature=temperature))
        first = prefill(self.loaded, ids, sampler,
                        lambda layer, k, v: kv.__setitem__(layer, (k.transpose(0, 1), v.transpose(0, 1))))
        tokens = [first.first_token]
        batch = DecodeBatch(self.loaded, max_batch=1)
        sequence = Sequence("reference", len(ids), first.first_token, sampler)
        batch.add(sequence, kv.__getitem__)
        while len(tokens) < max_tokens and tokens[-1] not in self.loaded.eos_token_ids:
            tokens.extend(token for _, token in batch.step())
        text = self.tokenizer.decode([t for t in tokens if t not in self.loaded.eos_token_ids],
                                     skip_special_tokens=True)
        usage = SimpleNamespace(prompt_tokens=len(ids), prompt_tokens_details=SimpleNamespace(cached_tokens=0))
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))], usage=usage)


@pytest.fixture(scope="module")
def reference(served_model):
    """The answers without reuse, from the engine with the weights the servers use."""
    return _workload(_Engine(served_model))


# -> the stage holding the store; "zero-copy": disaggregated over shm, where prefill computes the KV
# in the store's blocks and decode attends from them
DEPLOYMENTS = {"disaggregated": "kv-shuttle-0", "colocated": "worker-0", "zero-copy": "kv-shuttle-0"}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def reusing(request):
    server = shared_server(request, request.param)
    server.store_stage, server.deployment = DEPLOYMENTS[request.param], request.param
    return server


def test_reuse_gives_the_same_answers_and_reports_cached_tokens(reusing, reference):
    client = openai_client(reusing.url, timeout=120)
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
    stats = _settled_stats(reusing, reusing.store_stage)
    assert stats["leases"] == 0 and stats["leased_blocks"] == 0, held(stats)
    assert stats["hits"] >= 6 and stats["hit_tokens"] >= sum(by_turn), stats
    assert stats["checksum_failures"] == 0


def test_sixteen_at_once_give_the_same_answers(reusing, reference):
    if reusing.deployment == "zero-copy":
        pytest.skip("concurrent answers over shm: tests/test_e2e_transports.py")
    client = openai_client(reusing.url, timeout=300)
    jobs = [reference[i % len(reference)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: _chat(client, job[0]), jobs))
    for (answer, prompt, cached), (messages, ref_answer, ref_prompt, _) in zip(answers, jobs):
        assert prompt == ref_prompt
        assert answer == ref_answer, f"{messages[-1]['content'][:40]!r}: {answer!r} != {ref_answer!r}"
    assert sum(cached for _, _, cached in answers) > 0
    stats = _settled_stats(reusing, reusing.store_stage)
    assert stats["leases"] == 0 and stats["leased_blocks"] == 0, held(stats)


# a document no earlier test stored on either deployment's server (each has its own store), and two
# questions about it
_WAITING_PROMPTS = [[{"role": "system", "content": f"Field notes, a copy no other test reads.\n\n{FIELD_GUIDE}"},
                     {"role": "user", "content": question}] for question in QUESTIONS[:2]]
_WAITING_ANSWER: list[str] = []


def _waiting_reference(served_model) -> str:
    """The second question's answer without any cache (computed once for both deployments)."""
    if not _WAITING_ANSWER:
        _WAITING_ANSWER.append(_Engine(served_model).create("smollm2", _WAITING_PROMPTS[1], 0, MAX_TOKENS)
                               .choices[0].message.content)
    return _WAITING_ANSWER[0]


def test_a_prompt_sent_while_its_prefix_is_computed_waits_for_it(reusing, served_model):
    """The second question about a document no one asked about before arrives while prefill is
    computing the first: kv-shuttle plans it once the document's blocks are stored (not computed
    twice), and its answer is the one computed without any cache."""
    if reusing.deployment == "colocated":
        pytest.skip("the colocated worker plans a prompt when it computes it: nothing is in flight")
    first, second = _WAITING_PROMPTS
    client = openai_client(reusing.url, timeout=120)
    before = reusing.fresh_stats()[reusing.store_stage]
    with ThreadPoolExecutor(2) as pool:
        earlier = pool.submit(_chat, client, first)
        time.sleep(0.3)  # its prefill takes seconds here
        later = pool.submit(_chat, client, second)
        (_, _, cached_first), (answer, prompt, cached) = earlier.result(), later.result()
    assert cached_first == 0
    assert cached >= prompt - 40 - BLOCK, (prompt, cached)
    assert answer == _waiting_reference(served_model)
    stats = _settled_stats(reusing, reusing.store_stage)
    assert stats["prefix_waits"] == before["prefix_waits"] + 1, stats
    assert stats["prefix_waits_given_up"] == before["prefix_waits_given_up"], stats
    assert stats["leases"] == 0 and stats["leased_blocks"] == 0, held(stats)


def test_zero_copy_copies_no_kv_byte(reusing, reference):
    """Over shm, prefill's writes find every byte already in the store's blocks, the store sends
    decode (and prefill) nothing, and decode writes no answer back: it attends in the store."""
    if reusing.deployment != "zero-copy":
        pytest.skip("the zero-copy deployment only")
    client = openai_client(reusing.url, timeout=120)
    _chat(client, reference[0][0])
    _settled_stats(reusing, reusing.store_stage)
    stats = reusing.fresh_stats()
    prefill, shuttle, decode = (stats[stage] for stage in ("prefill-0", "kv-shuttle-0", "decode-0"))
    assert prefill["kv_copied_bytes"] == 0 and prefill["kv_in_place_bytes"] > 0, prefill
    assert shuttle["kv_copied_bytes"] == shuttle["kv_in_place_bytes"] == 0, shuttle
    assert decode["attends_in_store"] == 1 and decode["kv_copied_bytes"] == 0, decode


def test_a_client_gone_mid_answer_leaves_no_lease(reusing):
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Describe every town at length."}]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{reusing.url}/v1/chat/completions",
                         json={"model": "smollm2", "messages": messages, "max_tokens": 200, "stream": True,
                               "temperature": 0}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # one token in: hang up
    stats = _settled_stats(reusing, reusing.store_stage)
    assert stats["leases"] == 0 and stats["leased_blocks"] == 0, held(stats)
