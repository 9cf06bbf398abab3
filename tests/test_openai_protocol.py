"""Request validation (every bad input is a 400 naming its field) and response shapes."""

from __future__ import annotations

import json

import pytest

from pdflow.serving.openai_protocol import (
    ApiError, error_body, parse_chat_request, parse_completion_request, sampling_from,
)
from pdflow.serving.openai_responses import (
    chat_choice, chat_chunk, completion_choice, completion_chunk, new_request_id, response, sse, usage, usage_chunk,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


BAD_CHAT = [
    # (body, param, message fragment)
    (b'{"messages": [', None, "invalid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (json.dumps({"model": "m"}).encode(), "messages", "Field required"),
    (json.dumps({"messages": []}).encode(), "messages", "at least one message"),
    (json.dumps({"messages": "hi"}).encode(), "messages", "valid list"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "messages.0.content", "Field required"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),
     "messages.0.content", "must not be null for role 'user'"),
    (json.dumps({"messages": [{"role": "system", "content": None}]}).encode(),
     "messages.0.content", "must not be null for role 'system'"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
     "messages.0.content", "string or a list of text parts"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages.0.content", "'text'"),
    (json.dumps({"messages": [USER[0], {"role": "robot", "content": "x"}]}).encode(),
     "messages.1.role", "'system', 'user' or 'assistant'"),
    (chat(max_tokens="ten"), "max_tokens", "valid integer"),
    (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
    (chat(temperature=3), "temperature", "less than or equal to 2"),
    (chat(temperature="hot"), "temperature", "valid number"),
    (chat(top_p=0), "top_p", "greater than 0"),
    (chat(top_k=-2), "top_k", "greater than or equal to -1"),
    (chat(n=9), "n", "less than or equal to 8"),
    (chat(n=0), "n", "greater than or equal to 1"),
    (chat(top_logprobs=3), "top_logprobs", "needs logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (chat(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (chat(min_p=1.5), "min_p", "less than or equal to 1"),
    (chat(logit_bias={"x": 1}), "logit_bias", "token ids"),
    (chat(logit_bias={"07": 1}), "logit_bias", "no leading zeros"),
    (chat(logit_bias={"5": 101}), "logit_bias", "within [-100, 100]"),
    (chat(response_format={"type": "xml"}), "response_format.type", "'text', 'json_object' or 'json_schema'"),
    (chat(response_format={"type": "json_schema"}), "response_format", "needs a json_schema"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    (chat(tool_choice="required"), "tool_choice", "not supported"),
    (chat(echo=True), "echo", "not supported"),
    (chat(guided_json={"type": "object"}), "guided_json", "not supported"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (chat(stop=5), "stop", "string or a list of strings"),
    (chat(stop_token_ids=[1, "x"]), "stop_token_ids.1", "valid integer"),
    (chat(stream="yes"), "stream", "valid boolean"),
]


@pytest.mark.parametrize("body,param,fragment", BAD_CHAT)
def test_bad_chat_request_is_400_naming_the_field(body: bytes, param: str | None, fragment: str):
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param
    assert fragment in err.message
    if param:
        assert err.message.startswith(f"{param}: ")


BAD_COMPLETION = [
    (b"{not json", None, "invalid JSON"),
    (json.dumps({"model": "m"}).encode(), "prompt", "Field required"),
    (json.dumps({"prompt": ""}).encode(), "prompt", "must not be empty"),
    (json.dumps({"prompt": []}).encode(), "prompt", "must not be empty"),
    (json.dumps({"prompt": ["a"] * 65}).encode(), "prompt", "at most 64 prompts"),
    (json.dumps({"prompt": ["a", ""]}).encode(), "prompt", "prompt 1: must not be empty"),
    (json.dumps({"prompt": [[1, 2], [3, -1]]}).encode(), "prompt", "prompt 1: a list prompt"),
    (json.dumps({"prompt": [1, -3]}).encode(), "prompt", "token ids"),
    (json.dumps({"prompt": 7}).encode(), "prompt", "string or a list of token ids"),
    (json.dumps({"prompt": "a", "max_tokens": "ten"}).encode(), "max_tokens", "valid integer"),
    (json.dumps({"prompt": "a", "logprobs": 21}).encode(), "logprobs", "less than or equal to 20"),
    (json.dumps({"prompt": "a", "logprobs": True}).encode(), "logprobs", "valid integer"),
    (json.dumps({"prompt": "a", "suffix": "x"}).encode(), "suffix", "not supported"),
    (json.dumps({"prompt": "a", "best_of": 2}).encode(), "best_of", "not supported"),
    (json.dumps({"prompt": "a", "kv_ttl_s": -1}).encode(), "kv_ttl_s", "greater than or equal to 0"),
    (b'{"prompt": "a", "kv_ttl_s": Infinity}', "kv_ttl_s", "finite"),
]


@pytest.mark.parametrize("body,param,fragment", BAD_COMPLETION)
def test_bad_completion_request_is_400_naming_the_field(body: bytes, param: str | None, fragment: str):
    with pytest.raises(ApiError) as info:
        parse_completion_request(body)
    assert info.value.status == 400
    assert info.value.param == param
    assert fragment in info.value.message


def test_first_of_several_errors_is_reported():
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat(max_tokens=0, temperature=3, n=2))
    assert info.value.param == "max_tokens"


def test_error_body_has_openai_shape():
    err = ApiError("n: only n=1 is supported", param="n")
    assert error_body(err) == {"error": {"message": "n: only n=1 is supported",
                                         "type": "invalid_request_error", "param": "n", "code": None}}


DEFAULTS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop_token_ids": (), "ignore_eos": False,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
    "logit_bias": {}, "logprobs": None, "prompt_logprobs": None, "guide": "",
}


def test_chat_request_defaults_and_neutral_values_accepted():
    req = parse_chat_request(chat(response_format={"type": "text"}, frequency_penalty=0, n=1, tools=[],
                                  tool_choice="none", echo=False, best_of=1))
    assert req.model == "m" and not req.stream and req.stream_options is None
    assert req.max_tokens is None and req.stop == () and req.skip_special_tokens and req.kv_ttl_s is None
    assert sampling_from(req) == DEFAULTS


def test_chat_request_fields_reach_sampling():
    req = parse_chat_request(chat(
        max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, top_k=-1, seed=3,
        stop="###", stop_token_ids=[5, 6], ignore_eos=True, skip_special_tokens=False, kv_ttl_s=60,
        stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=4, user="u",
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1, min_tokens=2,
        logit_bias={"17": -100, "3": 0, "42": 5.5},
    ))
    assert req.stream and req.stream_options.include_usage
    assert req.max_tokens == 7 and req.stop == ("###",) and not req.skip_special_tokens and req.kv_ttl_s == 60
    assert sampling_from(req) == {
        **DEFAULTS, "temperature": 0.0, "top_p": 0.5, "seed": 3, "stop_token_ids": (5, 6), "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1,
        "min_tokens": 2, "logit_bias": {17: -100.0, 42: 5.5}, "logprobs": 4,
    }


def test_logprobs_fields_per_endpoint():
    assert sampling_from(parse_chat_request(chat(logprobs=True)))["logprobs"] == 0
    assert sampling_from(parse_chat_request(chat(logprobs=False, top_logprobs=0)))["logprobs"] is None
    completion = parse_completion_request(json.dumps({"prompt": "a", "logprobs": 3, "echo": True}).encode())
    assert sampling_from(completion)["logprobs"] == 3 and sampling_from(completion)["prompt_logprobs"] == 3
    plain = parse_completion_request(json.dumps({"prompt": "a", "logprobs": 0}).encode())
    assert sampling_from(plain)["logprobs"] == 0 and sampling_from(plain)["prompt_logprobs"] is None


def test_response_format_becomes_a_guide():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse_chat_request(chat(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    guide = json.loads(sampling_from(req)["guide"])
    assert guide == {"json_schema": schema}
    assert json.loads(sampling_from(parse_chat_request(chat(response_format={"type": "json_object"})))["guide"]) \
        == {"json_schema": {"type": "object"}}


def test_chat_content_parts_and_assistant_null():
    req = parse_chat_request(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c", "name": "bob"},
    ]}).encode())
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "c"},
    ]


@pytest.mark.parametrize("prompt,expected", [
    ("hello", ["hello"]), (["hello"], ["hello"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2]], [[1, 2]]),
    (["a", "b"], ["a", "b"]), (["a", [4, 5]], ["a", [4, 5]]),
])
def test_completion_prompt_forms(prompt, expected):
    req = parse_completion_request(json.dumps({"model": "m", "prompt": prompt, "stop": ["a", ""]}).encode())
    assert req.prompts() == expected
    assert req.stop == ("a",)


def test_response_shapes():
    rid = new_request_id(chat=True)
    assert rid.startswith("chatcmpl-") and new_request_id(chat=False).startswith("cmpl-")
    r = response(rid, "m", "fp", True, [chat_choice(0, "hey", "stop")], usage(5, 2))
    assert r["object"] == "chat.completion" and isinstance(r["created"], int) and r["system_fingerprint"] == "fp"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                             "logprobs": None, "finish_reason": "stop"}]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(500, 2, 448)["prompt_tokens_details"] == {"cached_tokens": 448}
    assert "completion_tokens_details" not in r["usage"]  # only when the server speculated
    assert usage(5, 9, 0, (10, 7))["completion_tokens_details"] == {
        "accepted_prediction_tokens": 7, "rejected_prediction_tokens": 3}

    first = chat_chunk(rid, "m", 10, "fp", 2, None, None, role_first=True)
    assert first["object"] == "chat.completion.chunk" and first["created"] == 10
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["choices"][0]["index"] == 2
    assert chat_chunk(rid, "m", 10, "fp", 0, "x", None)["choices"][0]["delta"] == {"content": "x"}
    last = chat_chunk(rid, "m", 10, "fp", 0, None, "length")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"

    c = response("cmpl-1", "m", "fp", False, [completion_choice(0, "t", "length")], usage(1, 1))
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t"
    assert completion_chunk("cmpl-1", "m", 10, "fp", 1, "t", None)["choices"][0]["finish_reason"] is None

    u = usage_chunk(rid, "m", 10, "fp", True, usage(3, 4))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 7
    assert u["object"] == "chat.completion.chunk"
    assert usage_chunk("cmpl-1", "m", 10, "fp", False, usage(3, 4))["object"] == "text_completion"


def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    frame = sse({"a": "é", "b": [1, None]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:-2]) == {"a": "é", "b": [1, None]}


def test_the_api_document_states_the_values_of_unsupported_fields_that_are_accepted():
    """A client that builds requests from /openapi.json (schemathesis adds extra properties to
    them) learns which values of a field pdflow does not do are accepted: exactly those."""
    from fastapi import FastAPI

    from pdflow.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
    from pdflow.serving.openapi import install_openapi

    app = FastAPI()
    install_openapi(app, (), "m", 100)
    schemas = app.openapi()["components"]["schemas"]
    for model, parse, base in ((ChatCompletionRequest, parse_chat_request, {"model": "m", "messages": USER}),
                               (CompletionRequest, parse_completion_request, {"prompt": "a"})):
        assert {"best_of", "tools", "suffix"} <= set(model.neutral)
        for name, values in model.neutral.items():
            stated = schemas[model.__name__]["properties"][name]["enum"]
            assert all(any(v == s and type(v) is type(s) for v in values) for s in stated), (name, stated)
            for value in stated:
                parse(json.dumps({**base, name: value}).encode())
            with pytest.raises(ApiError) as info:
                parse(json.dumps({**base, name: "something else"}).encode())
            assert info.value.param == name
    assert schemas["CompletionRequest"]["properties"]["length_penalty"]["enum"] == [None, 1]  # (1.0 is 1 in JSON)
