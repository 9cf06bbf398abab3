"""The HTTP API under hostile and careless clients: every refusal is a 4xx naming the field,
nothing a request carries reaches the sampler or the wire unchecked, large bodies and prompts
cost only themselves (refused early, tokenized off the event loop), slow clients are cut off, and
the OpenAPI document is complete enough for schemathesis to fuzz the API with no 5xx.

Against the session's shared server (``header_timeout_s = 2``, ``max_body_bytes = 1 MiB``). The
fuzzing is bounded for CI (``PDFLOW_FUZZ_EXAMPLES``, default 20 per operation); run it at length
with e.g. ``PDFLOW_FUZZ_EXAMPLES=500 scripts/test.sh tests/test_hostile_http.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

import httpx
import pytest

from pdflow.testing.local_http import local_http

pytestmark = pytest.mark.e2e

FUZZ_EXAMPLES = int(os.environ.get("PDFLOW_FUZZ_EXAMPLES", "20"))
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def _in_flight(server) -> int:
    return server.health()["in_flight"]


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": USER, "seed": 2**70}, "seed"),
    (CHAT, {"messages": USER, "seed": -(2**63) - 1}, "seed"),
    (CHAT, {"messages": USER, "top_k": 10**30}, "top_k"),
    (CHAT, {"messages": USER, "max_tokens": 2**40}, "max_tokens"),
    (CHAT, {"messages": USER, "stop_token_ids": list(range(100_000))}, "stop_token_ids"),
    (CHAT, {"messages": USER, "stop_token_ids": [2**40]}, "stop_token_ids.0"),
    (CHAT, {"messages": USER, "stop": ["x" * 5000]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2, 2**40]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt"),  # one past the vocabulary
    ("/v1/completions", {"prompt": "\x16"}, "prompt"),  # a text of no tokens
    ("/v1/completions", {"prompt": ["a", "\x16"]}, "prompt.1"),
])
def test_out_of_range_values_are_400s_naming_the_field_and_hold_no_slot(server, path, body, param):
    response = local_http().post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert _in_flight(server) == 0


@pytest.mark.parametrize("extra", [{"top_p": 5e-324}, {"temperature": 1e-300}, {"seed": 2**64 - 1, "top_k": 2**31 - 1},
                                   {"temperature": 2.0, "top_p": 5e-324, "seed": -(2**63)}])
def test_edge_values_that_are_accepted_are_served(server, extra):
    body = {"messages": USER, "max_tokens": 3, **extra}
    response = local_http().post(server.url + CHAT, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    big = json.dumps({"messages": [{"role": "user", "content": "a" * (2 * 2**20)}]}).encode()
    declared = local_http().post(server.url + CHAT, content=big, headers={"content-type": "application/json"},
                                 timeout=30)
    assert declared.status_code == 413 and declared.json()["error"]["param"] == "body"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    streamed = local_http().post(server.url + CHAT, content=chunks(), headers={"content-type": "application/json"},
                                 timeout=30)
    assert streamed.status_code == 413 and streamed.json()["error"]["param"] == "body"
    assert _in_flight(server) == 0


def _health_while(server, request) -> tuple[httpx.Response, float]:
    """Send ``request`` (a function) in a thread; meanwhile poll /health; the response and the
    slowest /health answer seen while it ran."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("response", request()))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        start = time.monotonic()
        local_http().get(server.url + "/health", timeout=30)
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    worker.join()
    return result["response"], slowest


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(server):
    text = "word " * 180_000  # 900 kB: under the body limit, at least 11,000 tokens by the cheap bound
    start = time.monotonic()
    response = local_http().post(server.url + CHAT, json={"messages": [{"role": "user", "content": text}]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 2.0
    assert "at least" in response.json()["error"]["message"]


def test_too_many_messages_are_refused_before_templating(server):
    messages = [{"role": "user", "content": "hi"}] * 25_001  # this server's max_messages is 25,000
    response = local_http().post(server.url + CHAT, json={"messages": messages}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "max_messages" in response.json()["error"]["message"]


def test_many_messages_are_templated_off_the_event_loop(server):
    """20,000 messages (under the body limit, under the cheap bound, under max_messages) must be
    templated and tokenized to be refused; /health keeps answering meanwhile."""
    messages = [{"role": "user", "content": "hi"}] * 20_000
    response, slowest = _health_while(server, lambda: local_http().post(server.url + CHAT, json={"messages": messages},
                                                                        timeout=120))
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the messages were tokenized"
    assert server.healthy() and _in_flight(server) == 0


def test_a_connection_that_never_sends_its_headers_is_closed(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        waited = time.monotonic() - start
    assert 1.0 < waited < 8.0, waited  # header_timeout_s = 2 on this server


def test_the_openapi_document_is_complete(server):
    document = local_http().get(server.url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    missing = {r for r in refs if r.removeprefix("#/components/schemas/") not in schemas}
    assert refs and not missing, missing
    for path in (CHAT, "/v1/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413", "429", "503", "504"} <= set(responses)


def _body_validator(document: dict):
    """Whether a body is valid under an operation's request schema in ``document`` (JSON Schema
    2020-12, the document's components resolvable)."""
    import jsonschema

    def valid(operation, body) -> bool:
        request = document["paths"][operation.path][operation.method.lower()].get("requestBody")
        if request is None or not isinstance(body, (dict, list)):
            return False
        schema = {**request["content"]["application/json"]["schema"], "components": document["components"]}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    return valid


def _keep_generation_short(body: dict) -> None:
    """At most 3 tokens and 8 choices: the API, not the model, is under test. A value out of
    range stays (a negative case may be invalid there); ``min_tokens`` stays within the new bound."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if (key == "max_tokens" and value is None) or (_number(value) and 3 < value < 2**31):
            body[key] = 3
    if _number(body.get("min_tokens")) and 3 < body["min_tokens"] < 2**31:
        body["min_tokens"] = 3
    if _number(body.get("n")) and 2 < body["n"] <= 8:  # and at most 8 choices in all
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 4 and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:4]


def _no_tokens(response) -> bool:
    """A 400 for a prompt (or one of a list's) whose text has no tokens: the document cannot say
    which texts have none (test_out_of_range_values_are_400s... pins this answer)."""
    if response.status_code != 400:
        return False
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return str(error.get("param")).split(".")[0] == "prompt" and "has no tokens" in str(error.get("message"))


def _number(value) -> bool:
    return type(value) in (int, float)


def test_schemathesis_finds_no_server_error(server):
    """Generated valid and invalid requests for every operation of the document: no 5xx, and every
    answer has a status and a body the document declares. Generation is capped at 3 tokens."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              positive_data_acceptance]
    valid_body = _body_validator(local_http().get(server.url + "/openapi.json", timeout=10).json())
    failures = []
    calls = 0
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation, mode in itertools.product(operations, schemathesis.GenerationMode):

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            nonlocal calls
            if isinstance(case.body, dict) and operation.path.startswith("/v1/"):
                _keep_generation_short(case.body)
            response = case.call(base_url=server.url, timeout=60)
            calls += 1
            # a "negative" case whose body the document's schema accepts after all (schemathesis mutates
            # one branch of an anyOf into another branch's type) is not one: it is not held to rejection
            negative = mode is schemathesis.GenerationMode.NEGATIVE and not valid_body(operation, case.body)
            held_to = [*checks, *([negative_data_rejection] if negative else [])]
            if _no_tokens(response):  # a valid text the tokenizer drops whole ("\x13"): refused by design
                held_to.remove(positive_data_acceptance)
            try:
                case.validate_response(response, checks=held_to)
            except (AssertionError, FailureGroup) as exc:
                failures.append(f"{operation.label} ({mode.value}): {str(exc)[:600]}")

        try:
            run()
        except Unsatisfiable:  # nothing of this operation can be invalid (no parameters, no body)
            assert mode is schemathesis.GenerationMode.NEGATIVE
    assert calls >= FUZZ_EXAMPLES and not failures, "\n".join(sorted(set(failures))[:8])
    assert server.healthy()
