"""The sampling and output API through the official openai client, against real servers of both
designs: disaggregated (prefill samples the first token, decode the rest: both must apply the same
rules) and the colocated worker. logprobs, echo with prompt logprobs, n, several prompts,
penalties, min_p, min_tokens, logit_bias, response_format, /tokenize and /detokenize, and the
fields that are refused rather than ignored."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.top import Scrape
from tests.conftest import shared_server

pytestmark = pytest.mark.e2e

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about " + "a red fox and a blue bird, " * 20}]  # ~196 tokens


@pytest.fixture(scope="module", params=("disaggregated", "colocated"))
def server(request):
    return shared_server(request, request.param)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


@pytest.fixture(scope="module")
def ingress_server(request):
    """For what ingress alone does (fan-out, streams, refusals, tokenizing): one design suffices."""
    return shared_server(request, "disaggregated")


@pytest.fixture(scope="module")
def ingress_client(ingress_server):
    return openai_client(ingress_server.url, timeout=120)


def test_chat_logprobs_and_top_logprobs(client):
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=8,
                                           logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(choice.message.content)
    for item in content:
        tops = item.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == item.token and tops[0].logprob == pytest.approx(item.logprob)  # greedy
        assert item.logprob <= 0 and bytes(item.bytes).decode("utf-8", "replace") == item.token
    assert reply.system_fingerprint.startswith("pdflow-")
    plain = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_completion_logprobs_agree_with_echoed_prompt_logprobs(client):
    """What lm-eval's loglikelihood relies on: the logprobs of generated tokens (prefill's first,
    decode's rest) equal those of the same tokens scored as a prompt (every position at once)."""
    prompt = "The capital of France is"
    gen = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    lp = gen.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == gen.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                           lp.token_logprobs))
    scored = client.completions.create(model="smollm2", prompt=prompt + gen.choices[0].text, max_tokens=1,
                                       temperature=0, logprobs=0, echo=True)
    echoed = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt + gen.choices[0].text)
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None  # nothing predicts the first
    n = len(echoed.tokens) - 1  # the prompt's tokens, then the one generated
    assert echoed.tokens[n - 6 : n] == lp.tokens
    assert echoed.token_logprobs[n - 6 : n] == pytest.approx(lp.token_logprobs, abs=2e-3)
    assert echoed.text_offset[n - 6] == len(prompt)


def test_n_choices_share_the_prompt_kv_and_each_seed_repeats(client, server):
    def cached() -> float:
        return Scrape.parse(local_http().get(f"{server.url}/metrics", timeout=10).text, 0).value(
            "pdflow_cached_prompt_tokens_total")

    before = cached()
    reply = client.chat.completions.create(model="smollm2", messages=STORY, temperature=1, max_tokens=8, n=4, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, texts  # seeds 7, 8, 9, 10
    prompt = reply.usage.prompt_tokens  # once, though four choices read it
    assert prompt > 128 and 4 <= reply.usage.completion_tokens <= 32
    assert cached() - before >= 3 * (prompt // 64 * 64 - 64)  # choices 1-3 start from choice 0's blocks
    again = client.chat.completions.create(model="smollm2", messages=STORY, temperature=1, max_tokens=8, n=4, seed=7)
    assert [c.message.content for c in again.choices] == texts


def test_several_prompts_with_n(ingress_client):
    client = ingress_client
    reply = client.completions.create(model="smollm2", prompt=["One, two,", [32, 28, 331, 28]], max_tokens=4,
                                      temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text != reply.choices[2].text == reply.choices[3].text
    single = client.completions.create(model="smollm2", prompt="One, two,", max_tokens=4, temperature=0)
    assert single.choices[0].text == reply.choices[0].text
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens + 4  # each prompt counted once


def test_streamed_choices_equal_the_whole_answers(ingress_client):
    client = ingress_client
    whole = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=8, n=2,
                                           logprobs=True)
    stream = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=8, n=2,
                                            logprobs=True, stream=True, stream_options={"include_usage": True})
    texts, logprobs, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    chunks = list(stream)
    for chunk in chunks:
        assert chunk.system_fingerprint == whole.system_fingerprint
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            logprobs[c.index] += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for c in whole.choices:
        assert texts[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert logprobs[c.index] == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-6)


def _ids(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return local_http().post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]


def test_penalties_bias_min_p_and_min_tokens_change_the_output(client, server):
    def answer(**fields) -> list[str]:
        extra = {k: fields.pop(k) for k in ("min_tokens", "min_p", "repetition_penalty") if k in fields}
        fields = {"temperature": 0, "max_tokens": 24, **fields}
        reply = client.chat.completions.create(model="smollm2", messages=FRANCE, extra_body=extra, logprobs=True,
                                               **fields)
        return [t.token for t in reply.choices[0].logprobs.content]

    tokens = answer()
    assert tokens[-1] == "<|im_end|>" and len(tokens) < 20  # it ends by itself
    assert answer(logit_bias={str(_ids(server, tokens[0])[0]): -100})[0] != tokens[0]
    assert answer(logit_bias={str(_ids(server, "!")[0]): 100}, max_tokens=3) == ["!"] * 3
    held = answer(min_tokens=len(tokens) + 3)
    assert len(held) >= len(tokens) + 3 and held[: len(tokens) - 1] == tokens[:-1]
    assert answer(temperature=1.0, seed=3, min_p=1.0) == tokens  # only the likeliest token survives min_p 1

    def repeats(prompt: str, **fields) -> int:
        reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                          **fields)
        tokens = reply.choices[0].logprobs.tokens
        return len(tokens) - len(set(tokens))

    for prompt, penalty in (("1, 1, 1, 1, 1, 1, 1,", {"frequency_penalty": 2.0}),
                            ("1, 1, 1, 1, 1, 1, 1,", {"extra_body": {"repetition_penalty": 2.0}}),
                            ("la la la la la la la la", {"presence_penalty": 2.0})):
        assert repeats(prompt, **penalty) < repeats(prompt), penalty


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
          "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain"]},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


def test_json_schema_output_validates_every_time(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=60, n=4, seed=11,
                                           temperature=1.0, response_format=response_format)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    anything = client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"echo": True}}, "echo"),
])
def test_fields_not_honoured_are_refused_naming_them(ingress_client, fields: dict, param: str):
    client = ingress_client
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=4, **fields)
    assert info.value.body["param"] == param


def test_tokenize_and_detokenize(ingress_client, ingress_server):
    client, server = ingress_client, ingress_server
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=1)
    chat = local_http().post(f"{server.url}/tokenize", json={"messages": FRANCE}, timeout=30).json()
    assert chat["count"] == len(chat["tokens"]) == reply.usage.prompt_tokens and chat["max_model_len"] > 0
    text = local_http().post(f"{server.url}/tokenize", json={"prompt": "hello world", "return_token_strs": True},
                             timeout=30).json()
    assert "".join(text["token_strs"]) == "hello world"
    back = local_http().post(f"{server.url}/detokenize", json={"tokens": text["tokens"]}, timeout=30).json()
    assert back == {"prompt": "hello world"}
    bad = local_http().post(f"{server.url}/detokenize", json={"tokens": [10**8]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = local_http().post(f"{server.url}/tokenize", json={"prompt": "a", "messages": FRANCE}, timeout=30)
    assert both.status_code == 400
