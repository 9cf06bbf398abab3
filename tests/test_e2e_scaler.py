"""The adaptive scaler on a real pipeline: a burst makes it start a second decode (and prefill)
replica, which then serves requests; when the load falls, a replica drains and is parked; every
request through both changes answers as it does alone (greedy), none lost or cut."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.server import PdflowServer, replicated_ports, replicated_topology
from pdflow.top import Scrape

pytestmark = pytest.mark.e2e

REPLICAS = {"prefill": 2, "decode": 2}
SCALER = """
[scaler]
interval_s = 0.25
window_s = 3
decode_queue_per_replica = 3
prefill_queue_per_replica = 3
tbt_slo_ms = 60000
ttft_slo_ms = 60000
up_after_s = 0.5
down_after_s = 1.5
cooldown_s = 1
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    topology = replicated_topology(REPLICAS, SCALER, min_replicas={"prefill": 1, "decode": 1})
    with PdflowServer(tmp_path_factory.mktemp("pdflow-scaler"), topology=topology,
                      ports=replicated_ports(REPLICAS)) as running:
        yield running


def _states(server) -> dict[str, str]:
    return {name: s["state"] for name, s in server.health()["stages"].items()}


def _wait_for(server, name: str, state: str, timeout_s: float, seen: list) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = _states(server)
        seen.append(states)
        if states.get(name) == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} never became {state}: last states {seen[-1]}")


QUESTIONS = [f"Write a short list of {n} animals." for n in (3, 4, 5, 6, 7, 8, 9, 10)]


async def _ask(aclient, question: str) -> str:
    reply = await aclient.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                  temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].message.content


def test_a_burst_adds_replicas_that_serve_and_quiet_parks_them_with_every_answer_whole(server):
    seen: list[dict[str, str]] = []
    states = _states(server)
    assert states["decode-1"] == "parked" and states["prefill-1"] == "parked" and states["decode-0"] == "ready"
    health = local_http().get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200  # parked replicas are as they should be

    client = openai_client(server.url, timeout=120)
    alone = {q: client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=40,
        extra_body={"ignore_eos": True}).choices[0].message.content for q in QUESTIONS}

    async def load(rounds_while) -> list[tuple[str, str]]:
        aclient = openai_client(server.url, asynchronous=True, timeout=180)
        answers = []
        while rounds_while():
            batch = await asyncio.gather(*(_ask(aclient, q) for q in QUESTIONS))
            answers += list(zip(QUESTIONS, batch))
        return answers

    def until_decode_1_is_ready() -> bool:
        seen.append(_states(server))
        return seen[-1]["decode-1"] != "ready"

    # bursts of 8 at a time on one decode replica: 8 > 3 per replica, so it starts decode-1
    answers = asyncio.run(load(until_decode_1_is_ready))
    assert _states(server)["decode-1"] == "ready"  # (it joins in well under a second: forked ready-made)

    # with both ready, a burst uses both
    def steps(replica: str) -> float:
        return Scrape.parse(local_http().get(f"{server.url}/metrics", timeout=10).text, 0).value(
            "pdflow_decode_steps_total", stage="decode", replica=replica)

    before = steps("1")
    rounds = iter(range(1))
    answers += asyncio.run(load(lambda: next(rounds, None) is not None))
    deadline = time.monotonic() + 5
    while steps("1") == before and time.monotonic() < deadline:  # its counters come with its heartbeat
        time.sleep(0.2)
    assert steps("1") > before

    # quiet: decode-1 (of two idle ones, the higher slot) drains and is parked; decode-0 stays
    _wait_for(server, "decode-1", "parked", 60, seen)
    final = _states(server)
    assert final["decode-0"] == "ready" and "ready" in (final["prefill-0"], final["prefill-1"]), final

    # nothing lost, nothing cut: every answer is the one the request gets alone
    # a burst or more while decode-1 starts (one when a burst outlasts its start, as on a slow
    # machine), then one with both ready
    assert len(answers) >= 2 * len(QUESTIONS)
    for question, answer in answers:
        assert answer == alone[question], question
    log = server.log()
    assert "scaler.up" in log and "requests per replica > 3" in log
    assert "scaler.down" in log and "scaler.parked" in log
    assert "stage.died" not in log
