"""End to end with speculative decoding (prompt lookup) in decode (the colocated worker runs the same
batch code, tested in test_speculative.py, and emits tokens as decode does):
greedy answers are token for token those of the engine in this process without speculation,
drafts were verified and kept (/health counts them), and stop rules still cut where they must."""

from __future__ import annotations

import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.reference import chat_ids, greedy_answer
from pdflow.testing.server import PdflowServer
from pdflow.top import Scrape
from tests.grafana import ONLY_WITH_SPECULATION, dashboard_metrics

pytestmark = pytest.mark.e2e

PASSAGE = ("The river Wen rises in the hills above Carrow and runs south for forty miles. Its water turned "
           "three mills; the largest, at Dunmere, ground grain for the valley until a flood broke its wheel in 1931.")
QUESTIONS = [f"Here is a passage:\n{PASSAGE}\nRepeat the passage exactly, word for word.",
             f"Answer from this passage, quoting it.\n{PASSAGE}\nWhat happened to the mill at Dunmere?",
             "Name three primary colors."]
SPECULATIVE = '\n[speculative]\nmethod = "ngram"\nnum_tokens = 4\n'


@pytest.fixture(scope="module", params=["disaggregated"])
def server(request, tmp_path_factory):
    with PdflowServer(tmp_path_factory.mktemp(request.param), mode=request.param, extra=SPECULATIVE) as running:
        running.mode = request.param
        yield running


def test_greedy_answers_are_those_without_speculation(server, served_model):
    client = openai_client(server.url, timeout=120)
    for question in QUESTIONS:
        reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=48)
        assert reply.choices[0].message.content == greedy_answer(*served_model, chat_ids(served_model[1], question), 48), question
        assert reply.usage.completion_tokens <= 48
        details = reply.usage.completion_tokens_details  # draft tokens kept and rejected, per request
        if question == QUESTIONS[0]:
            assert details.accepted_prediction_tokens > 0
        if details is not None:
            assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    stats = server.quiet_stats()["decode-0" if server.mode == "disaggregated" else "worker-0"]  # (heartbeats)
    assert stats["speculative_accepted"] > 0 and stats["speculative_proposed"] >= stats["speculative_accepted"]
    assert stats["speculative_speculative_steps"] <= stats["speculative_steps"]
    # the same counts in vLLM's names, as the shipped dashboard reads them
    scrape = Scrape.parse(local_http().get(f"{server.url}/metrics", timeout=10).text, 0.0)
    engine = {"model_name": "smollm2", "engine": "decode-0"}
    assert scrape.value("vllm:spec_decode_num_accepted_tokens_total", **engine) == stats["speculative_accepted"]
    assert scrape.value("vllm:spec_decode_num_draft_tokens_total", **engine) == stats["speculative_proposed"]
    assert scrape.value("vllm:spec_decode_num_drafts_total", **engine) == stats["speculative_drafts"]
    assert ONLY_WITH_SPECULATION <= dashboard_metrics()


def test_a_stop_string_inside_a_kept_draft_still_ends_the_answer(server):
    client = openai_client(server.url, timeout=120)
    full = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                          temperature=0, max_tokens=40).choices[0].message.content
    word = full.split()[6]
    cut = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                         temperature=0, max_tokens=40, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(word)]
