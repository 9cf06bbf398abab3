"""End to end with int8 KV over tcp, two ways: on every link (encoded as it leaves prefill,
decoded where it lands, the store holding decoded KV), and in the store's memory (its blocks kept
encoded: 3.9x of them in the same bytes; chunks into it encoded by their senders, out of it
decoded where they land). Either way the answers are those of the engine in this process given the
prompt's KV after the codec, and a later turn reuses the stored prefix."""

from __future__ import annotations


import pytest

from pdflow.testing.local_http import openai_client
from pdflow.testing.reference import chat_ids, greedy_answer
from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Describe a cat in five words."]


@pytest.fixture(scope="module", params=["link", "store"])
def server(request, tmp_path_factory, model_dir):
    where = {"codec": "int8"} if request.param == "link" else {"kv": {"codec": "int8", "store_bytes": "64MiB"}}
    with PdflowServer(tmp_path_factory.mktemp(f"int8-{request.param}"), **where) as running:
        running.codec_in = request.param
        yield running


def _reference(served_model, question: str, max_tokens: int) -> str:
    """The greedy answer of the engine here, decode attending over the prompt's KV after a trip
    through int8 (as decode's blocks hold it)."""
    from pdflow.bench.kv_codecs import compressed
    from pdflow.kv.codecs import codec

    loaded, tokenizer = served_model
    return greedy_answer(loaded, tokenizer, chat_ids(tokenizer, question), max_tokens,
                         lambda keys, values: compressed(codec("int8"), keys, values, 64))



def test_answers_are_those_of_the_kv_after_the_codec(server, served_model):
    client = openai_client(server.url, timeout=120)
    for question in QUESTIONS:
        reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=16)
        assert reply.choices[0].message.content == _reference(served_model, question, 16), question
    stats = server.quiet_stats()  # heartbeats carry the counters
    prefill, shuttle, decode = stats["prefill-0"], stats["kv-shuttle-0"], stats["decode-0"]
    assert decode["kv_chunks_decoded"] >= 60 * len(QUESTIONS) and decode["kv_chunks_undecodable"] == 0
    if server.codec_in == "link":
        assert prefill["kv_chunks_encoded"] >= 60 * len(QUESTIONS)  # every layer's keys and values
        assert prefill["kv_bytes_before_encoding"] > 3.8 * prefill["kv_bytes_encoded"]
        assert shuttle["kv_chunks_decoded"] >= prefill["kv_chunks_encoded"] and shuttle["kv_chunks_undecodable"] == 0
        assert shuttle["kv_chunks_encoded"] > 0  # on to decode (and answers' blocks back in)
    else:  # the store keeps what arrives encoded; 64 MiB hold 3.9x the fp32 blocks
        assert shuttle.get("kv_chunks_decoded", 0) == 0 and shuttle.get("kv_chunks_undecodable", 0) == 0
        assert shuttle["blocks_total"] >= 3.9 * (64 << 20) // (30 * 2 * 64 * 768)


def test_a_later_turn_reuses_the_stored_prefix_through_the_codec(server):
    client = openai_client(server.url, timeout=120)
    history = [{"role": "user", "content": "Tell me about the ocean. " * 30}]
    first = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=12)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And about rivers?"}]
    second = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=12)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 128  # the prefix came from the store, encoded
    assert server.quiet_stats()["prefill-0"]["kv_chunks_decoded"] > 0
