"""Request validation (every bad input is a 400 naming its field) and response shapes."""

from __future__ import annotations

import json

import pytest

from pdflow.serving.openai_protocol import (
    ApiError, chat_chunk, chat_response, completion_chunk, completion_response, error_body,
    new_request_id, parse_chat_request, parse_completion_request, sampling_from, sse, usage_chunk,
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
    (json.dumps({"messages": "hi"}).encode(), "messages", "valid array"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "messages.0.content", "Field required"),
    (json.dumps({"messages": [{"role": "user", "content": ""}]}).encode(),
     "messages.0.content", "must not be empty"),
    (json.dumps({"messages": [{"role": "user", "content": []}]}).encode(),
     "messages.0.content", "must not be empty"),
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
    (chat(n=2), "n", "n=1"),
    (chat(logprobs=True), "logprobs", "not supported"),
    (chat(presence_penalty=0.5), "presence_penalty", "not supported"),
    (chat(frequency_penalty=-1), "frequency_penalty", "not supported"),
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
    (json.dumps({"prompt": ["a", "b"]}).encode(), "prompt", "one prompt"),
    (json.dumps({"prompt": [[1, 2]]}).encode(), "prompt", "one prompt"),
    (json.dumps({"prompt": [1, -3]}).encode(), "prompt", "token ids"),
    (json.dumps({"prompt": 7}).encode(), "prompt", "string or a list of token ids"),
    (json.dumps({"prompt": "a", "max_tokens": "ten"}).encode(), "max_tokens", "valid integer"),
    (json.dumps({"prompt": "a", "n": 3}).encode(), "n", "n=1"),
    (json.dumps({"prompt": "a", "logprobs": 2}).encode(), "logprobs", "not supported"),
    (json.dumps({"prompt": "a", "echo": True}).encode(), "echo", "not supported"),
    (json.dumps({"prompt": "a", "best_of": 2}).encode(), "best_of", "best_of=1"),
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


def test_chat_request_defaults_and_extras_ignored():
    req = parse_chat_request(chat(response_format={"type": "text"}, frequency_penalty=0, n=1))
    assert req.model == "m" and not req.stream and req.stream_options is None
    assert sampling_from(req) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": None,
        "stop": (), "stop_token_ids": (), "ignore_eos": False, "skip_special_tokens": True, "kv_ttl_s": None,
    }


def test_chat_request_fields_reach_sampling():
    req = parse_chat_request(chat(
        max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, top_k=-1, seed=3,
        stop="###", stop_token_ids=[5, 6], ignore_eos=True, skip_special_tokens=False, kv_ttl_s=60,
        stream=True, stream_options={"include_usage": True}, logprobs=False, user="u",
    ))
    assert req.stream and req.stream_options.include_usage
    assert sampling_from(req) == {
        "temperature": 0.0, "top_p": 0.5, "top_k": 0, "seed": 3, "max_tokens": 7,
        "stop": ("###",), "stop_token_ids": (5, 6), "ignore_eos": True, "skip_special_tokens": False,
        "kv_ttl_s": 60.0,
    }


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


@pytest.mark.parametrize("prompt,expected", [("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3])])
def test_completion_prompt_forms(prompt, expected):
    req = parse_completion_request(json.dumps({"model": "m", "prompt": prompt, "stop": ["a", ""]}).encode())
    assert req.prompt == expected
    assert sampling_from(req)["stop"] == ("a",)


def test_response_shapes():
    rid = new_request_id(chat=True)
    assert rid.startswith("chatcmpl-") and new_request_id(chat=False).startswith("cmpl-")
    r = chat_response(rid, "m", "hey", "stop", 5, 2)
    assert r["object"] == "chat.completion" and isinstance(r["created"], int)
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                             "logprobs": None, "finish_reason": "stop"}]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert chat_response(rid, "m", "hey", "stop", 500, 2, 448)["usage"]["prompt_tokens_details"] == {"cached_tokens": 448}
    assert "completion_tokens_details" not in r["usage"]  # only when the server speculated
    assert chat_response(rid, "m", "hey", "stop", 5, 9, 0, (10, 7))["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 7, "rejected_prediction_tokens": 3}

    first = chat_chunk(rid, "m", 10, None, None, role_first=True)
    assert first["object"] == "chat.completion.chunk" and first["created"] == 10
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_chunk(rid, "m", 10, "x", None)["choices"][0]["delta"] == {"content": "x"}
    last = chat_chunk(rid, "m", 10, None, "length")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"

    c = completion_response("cmpl-1", "m", "t", "length", 1, 1)
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t"
    assert completion_chunk("cmpl-1", "m", 10, "t", None)["choices"][0]["finish_reason"] is None

    u = usage_chunk(rid, "m", 10, 3, 4, chat=True)
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 7
    assert usage_chunk(rid, "m", 10, 300, 4, chat=True, cached_tokens=256)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 256}
    assert u["object"] == "chat.completion.chunk"
    assert usage_chunk("cmpl-1", "m", 10, 3, 4, chat=False)["object"] == "text_completion"


def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    frame = sse({"a": "é", "b": [1, None]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:-2]) == {"a": "é", "b": [1, None]}
