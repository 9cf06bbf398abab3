"""End to end with each other data plane selected in the topology: same answers, KV still streamed.

tcp runs the whole of tests/test_e2e.py; here every other transport usable across processes on
this machine (shm, ucx) runs the core of it: the Paris answer, concurrent streams equal to their
single-request outputs, and layer-by-layer overlap. A transport that is not usable here is
skipped with the reason.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pdflow import transports
from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.server import PdflowServer

pytestmark = pytest.mark.e2e

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Describe a cat in five words."]


@pytest.fixture(scope="module", params=["shm", "ucx"])
def server(request, tmp_path_factory, model_dir):
    problem = transports.availability(request.param)
    if problem:
        pytest.skip(f"transport {request.param!r} is not available here: {problem}")
    if request.param == "shm":  # the session's (tests/test_prefix_reuse.py uses it too)
        yield request.getfixturevalue("shm_server")
        return
    with PdflowServer(tmp_path_factory.mktemp(request.param), transport=request.param) as running:
        yield running


async def _answer(client, question: str) -> str:
    stream = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=20,
        stream=True,
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_same_answers_alone_and_together(server):
    async def scenario():
        client = openai_client(server.url, asynchronous=True, timeout=180)
        single = {q: await _answer(client, q) for q in QUESTIONS}
        together = await asyncio.gather(*(_answer(client, q) for q in QUESTIONS * 3))
        return single, together

    single, together = asyncio.run(scenario())
    assert "Paris" in single[QUESTIONS[0]]
    assert together == [single[q] for q in QUESTIONS * 3]


def test_layers_stream_while_prefill_computes(server):
    # about 600 tokens (as tests/test_e2e.py's): 29 layers computed after layer 0
    prompt = "Summarize: " + " ".join(f"item {i} shipped on day {i % 30} in good order." for i in range(45))
    reply = local_http().post(f"{server.url}/v1/completions", timeout=120,
                              json={"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
    timeline = local_http().get(f"{server.url}/debug/timeline/{reply['id']}").json()
    assert len(timeline["decode.layer_in"]) == 30
    assert timeline["decode.layer_in"][0] < timeline["prefill.layer_done"][-1]



def test_zero_copy_survives_a_restart_of_the_store(server):
    """shm only (prefill computes into the store's blocks, decode attends from them): kill -9 of
    kv-shuttle under streaming clients with random aborts: no request is lost, decode moves to the
    new store's memory once its batch drained, nothing is left behind, and greedy answers stay what
    they were. (Last in this module: it restarts a stage of the session's shm server.)"""
    if 'transport = "shm"' not in server.topology.read_text():
        pytest.skip("the zero-copy path runs over shm")
    from pdflow.testing import faults

    def answers() -> list[str]:
        client = openai_client(server.url, timeout=120)
        return [client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                               temperature=0, max_tokens=20).choices[0].message.content
                for q in QUESTIONS]

    faults.settled(server)
    assert server.health()["stages"]["decode-0"]["stats"]["attends_in_store"] == 1
    expected, shm_before = answers(), faults.shm_segments()
    load = faults.Load(server.url, clients=3, abort_ratio=0.2, max_tokens=12, bound_s=40).start()
    old = []
    try:
        time.sleep(2)
        old.append(faults.kill9(server, "kv-shuttle-0"))
        assert faults.wait_replaced(server, "kv-shuttle-0", old[-1], 120) is not None, server.log()
        time.sleep(2)
    finally:
        outcomes = load.stop()
    lost = [o for o in outcomes if o.kind == "lost"]
    assert not lost, lost[:3]
    counts, migrations = load.counts(), server.health()["stages"]["ingress-0"]["stats"]["migrations"]
    assert counts["ok"] > 0 and counts["error"] + migrations > 0, counts  # the faults did reach requests
    assert all(o.seconds < 40 for o in outcomes)
    faults.settled(server)
    faults.none_left_behind(old, shm_before)
    assert answers() == expected
