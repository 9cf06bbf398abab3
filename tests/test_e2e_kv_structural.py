"""End to end with a structural KV codec on the link into decode: ``sink-window`` (decode gets and
attends over the prompt's first and last blocks only, each token at its own position, and its
generated tokens at the positions after the whole prompt) and ``head-prune`` (the pruned kv heads'
KV never leaves kv-shuttle, and decode attends with the kept heads only). Either way the answer is
the one the engine in this process gives from the same kept KV, the store keeps the whole prompt
(a later request reuses it), and decode keeps no answer KV it computed without all of it."""

from __future__ import annotations


import pytest

from pdflow.testing.local_http import openai_client
from pdflow.testing.reference import chat_ids, greedy_answer
from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

BLOCK = 64
CODECS = {
    "sink-window": {"sink": 4, "window": 100},
    "head-prune": {"pruned": "0.2/4.1/7.0/12.1/25.0"},
}
# long enough that sink + window drops blocks (4 blocks of 64 and a part; 1 sink block and the last 2 kept)
QUESTION = ("Read this note and answer. " + "The lighthouse keeper wrote in his log every evening. " * 24
            + "What did the keeper do every evening?")


@pytest.fixture(scope="module", params=list(CODECS))
def server(request, tmp_path_factory):
    name = request.param
    with PdflowServer(tmp_path_factory.mktemp(name), decode_codec=name, decode_codec_options=CODECS[name],
                      kv={"block_tokens": BLOCK, "store_bytes": "256MiB", "decode_pool_bytes": "256MiB"}) as running:
        running.codec = name
        yield running


def _reference(served_model, codec_name: str, ids: list[int], max_tokens: int) -> str:
    """The greedy answer of the engine here from the KV the codec lets decode have."""
    from pdflow.bench.kv_codecs import compressed
    from pdflow.kv.codecs import codec

    loaded, tokenizer = served_model
    return greedy_answer(loaded, tokenizer, ids, max_tokens,
                         lambda keys, values: compressed(codec(codec_name, **CODECS[codec_name]), keys, values, BLOCK))



def test_decode_answers_from_what_the_codec_keeps(server, served_model):
    _, tokenizer = served_model
    messages = [{"role": "user", "content": QUESTION}]
    ids = chat_ids(tokenizer, QUESTION)
    assert len(ids) > 4 * BLOCK
    client = openai_client(server.url, timeout=120)
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20)
    assert reply.choices[0].message.content == _reference(served_model, server.codec, ids, 20)
    # the same prompt again: its prefix comes from the store, whole (prefill needs it all); decode
    # again gets only what the codec keeps, and answers as before
    again = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20)
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * BLOCK
    assert again.choices[0].message.content == reply.choices[0].message.content
    stats = server.quiet_stats()  # heartbeats carry the counters
    shuttle, decode = stats["kv-shuttle-0"], stats["decode-0"]
    assert decode.get("kv_chunks_undecodable", 0) == 0
    if server.codec == "sink-window":
        from pdflow.kv.codecs import codec

        kept = codec("sink-window", **CODECS["sink-window"]).kept_blocks(len(ids), BLOCK)
        assert len(kept) < -(-len(ids) // BLOCK)
        dropped = len(ids) - sum(min(BLOCK, len(ids) - block * BLOCK) for block in kept)
        assert decode["kv_prompt_tokens_dropped"] == 2 * dropped  # (both requests)
    else:  # 5 of 90 kv heads stay in kv-shuttle
        assert shuttle["kv_bytes_before_encoding"] * 85 == shuttle["kv_bytes_encoded"] * 90
        assert decode["kv_chunks_decoded"] >= 2 * 60


def test_the_answer_kv_is_not_stored(server, served_model):
    """Decode computed the answer without part of the prompt's KV: that is not the answer's KV,
    so it does not go into the store; the prompt's own blocks do."""
    client = openai_client(server.url, timeout=120)
    first = [{"role": "user", "content": "Tell me about the ocean. " * 30}]
    reply = client.chat.completions.create(model="smollm2", messages=first, temperature=0, max_tokens=70)
    answer = reply.choices[0].message.content
    history = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And rivers?"}]
    second = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=8)
    _, tokenizer = served_model
    prompt = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=False)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(prompt) // BLOCK * BLOCK  # the first prompt's blocks were reused ...
    assert cached < (len(prompt) // BLOCK + 1) * BLOCK  # ... and nothing of decode's answer
