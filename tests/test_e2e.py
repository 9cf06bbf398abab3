"""End to end: real stage processes started by `pdflow run`, the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.timeline import chrome_trace, kv_summary
from tests.conftest import shared_server

pytestmark = pytest.mark.e2e

# The same tests against both designs: disaggregated (tcp data plane) and the colocated worker
# with chunked prefill.
DEPLOYMENTS = ("disaggregated", "colocated")


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def server(request):
    running = shared_server(request, request.param)
    running.mode = request.param
    return running

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Count from one to ten in words.",
    "What is 12 times 12?",
    "Write one sentence about the moon.",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "Describe a cat in five words.",
]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    return openai_client(server.url, asynchronous=True, timeout=180)


def test_chat_completion_answers_paris(client):
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_streaming_chat_answers_paris(client):
    stream = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens > 0


def test_streamed_and_plain_agree(client):
    plain = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=20)
    stream = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=20,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == plain.choices[0].message.content


def test_completions_max_tokens_and_stop(client):
    full = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                     max_tokens=5)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 5
    first_word = full.choices[0].text.split()[0]
    stopped = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                        max_tokens=5, stop=[first_word])
    assert stopped.choices[0].finish_reason == "stop"
    assert first_word not in stopped.choices[0].text


def test_seeded_sampling_repeats(client):
    kwargs = dict(model="smollm2", messages=FRANCE, temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    health = server.health()
    assert health["status"] == "ok"
    expected = {"ingress-0", "prefill-0", "kv-shuttle-0", "decode-0"}
    if server.mode == "colocated":
        expected = {"ingress-0", "worker-0"}
    assert set(health["stages"]) == expected
    # each stage's stats come with the seq of the heartbeat that brought them, which moves on (at
    # 0.5 s a heartbeat, the default, and a publication as often)
    began = time.monotonic()
    seqs = {name: stage["heartbeat"] for name, stage in health["stages"].items()}
    later = server.fresh_stats()
    assert set(later) == expected and time.monotonic() - began < 3
    assert all(stage["heartbeat"] >= seqs[name] + 2 for name, stage in server.health()["stages"].items())


async def _stream_text(aclient, question: str) -> str:
    stream = await aclient.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=12,
        stream=True,
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_32_concurrent_streams_each_equal_its_single_request_output(aclient):
    async def scenario():
        single = {q: await _stream_text(aclient, q) for q in QUESTIONS}
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(32)]
        together = await asyncio.gather(*(_stream_text(aclient, q) for q in questions))
        return single, questions, together

    single, questions, together = asyncio.run(scenario())
    assert all(single.values())
    for question, text in zip(questions, together):
        assert text == single[question], question


def test_decode_receives_layer_0_before_prefill_finishes_its_last_layer(client, server):
    if server.mode == "colocated":
        pytest.skip("colocated: the KV never leaves the worker")
    # about 600 tokens: prefill computes 29 more layers, each of tens of ms, after layer 0 (2,000
    # were 1,400 more tokens of prefill, at 3-4 ms of CPU each, for the same order of events)
    long_prompt = "Summarize the following notes. " + " ".join(
        f"Note {i}: the shipment of part {i * 7} arrived on day {i % 30} in good order." for i in range(27)
    )
    reply = client.completions.create(model="smollm2", prompt=long_prompt, temperature=0, max_tokens=2)
    assert reply.usage.prompt_tokens > 500
    timeline = local_http().get(f"{server.url}/debug/timeline/{reply.id}").json()
    layers = len(timeline["prefill.layer_done"])
    assert layers == 30 and len(timeline["decode.layer_in"]) == layers
    # recorded with one monotonic clock on this host: layer 0 landed in decode's memory
    # (through kv-shuttle) while prefill was still computing later layers
    assert timeline["decode.layer_in"][0] < timeline["prefill.layer_done"][-1]
    assert all(t > 0 for t in timeline["decode.layer_in"])

    trace = json.loads(json.dumps(chrome_trace(timeline, reply.id)))
    for lane in ("compute", "KV transfer"):
        layers = sorted(e["args"]["layer"] for e in trace["traceEvents"] if e["tid"] == lane)
        assert layers == list(range(30)), lane
    assert kv_summary(timeline)["kv_tail_s"] < kv_summary(timeline)["whole_transfer_s"] + 1e-9


def test_the_direct_path_fills_decode_s_pool_from_prefill_and_the_store_behind_it(client, server, model_dir):
    """The shared disaggregated server runs kv.direct: a prompt with no prefix stored has prefill
    write its whole KV into decode's pool (the store forwards none of it) and into the store
    behind it; the same prompt again finds that prefix stored and goes through the store, with the
    same answer. A prompt goes direct when decode's pool destination reaches the store before
    prefill asks for its plan (decode is told first); where prefill wins that race (a loaded
    machine), the prompt goes through the store, whole: a few fresh prompts, until one goes direct."""
    if server.mode == "colocated":
        pytest.skip("colocated: the KV never leaves the worker")
    from pdflow.kv.layout import KvLayout

    kv = KvLayout.from_model_dir(model_dir, server.pipeline().model.dtype)

    def sent() -> tuple[int, int]:
        stats = server.fresh_stats()
        return stats["prefill-0"].get("kv_sent_bytes@decode", 0), stats["kv-shuttle-0"]["kv_sent_bytes@decode"]

    for attempt in range(4):
        prompt = f"Direct path check {time.time_ns()}. " + " ".join(  # about 220 tokens: three blocks and a bit
            f"Item {i}: a crate of {i * 3 + attempt} lamps left the dock on day {i % 28}." for i in range(10))
        before = sent()
        first = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=8)
        middle = sent()
        n = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        if middle[0] > before[0]:
            break
        assert middle[1] - before[1] == kv.request_bytes(n)  # prefill asked first: all of it through the store
    else:
        pytest.fail("no prompt of 4 went the direct path")
    assert middle[0] - before[0] == kv.request_bytes(n)  # every byte of its KV, from prefill
    assert middle[1] == before[1]  # none through the store
    again = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=8)
    after = sent()
    assert again.usage.prompt_tokens_details.cached_tokens >= n - 64  # stored behind the direct writes
    assert after[0] == middle[0] and after[1] > middle[1]  # a stored prefix: through the store
    assert again.choices[0].text == first.choices[0].text


def test_client_disconnect_cancels_everywhere(server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen += 1
            if seen >= 5:
                break
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        health = server.health()
        if health["in_flight"] == 0 and all(s["in_flight"] == 0 for s in health["stages"].values()):
            break
        time.sleep(0.25)
    else:
        pytest.fail(f"request still in flight after the client left: {health}")
    assert "request.cancelled" in server.log()


LONG_PROMPT = "hello " * 9000


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        ("/v1/chat/completions", b"{not json", None, "invalid JSON"),
        ("/v1/chat/completions", {"model": "smollm2"}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content", "null"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": FRANCE}, "model", "gpt-9"),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 0}, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 100000}, "max_tokens", "context"),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": "ten"}, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {"messages": FRANCE, "temperature": "hot"}, "temperature", "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages", "context"),
        ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt", "context"),
        ("/v1/completions", {"model": "smollm2"}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 9}, "n", "n"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias", "token ids"),
        ("/v1/chat/completions", {"messages": FRANCE, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
         "uniqueItems"),
    ],
)
def test_bad_input_gets_400_naming_the_field(server, path, body, param, fragment):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = local_http().post(f"{server.url}{path}", headers={"content-type": "application/json"}, timeout=30,
                                 **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=0)
