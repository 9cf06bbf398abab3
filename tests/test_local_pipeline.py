"""A whole pipeline in one process (LocalPipeline): the official `openai` client against it, the
leaks that used to become hangs (every table empty once requests end), and a handler exception
reaching the client as an error at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pdflow import LocalPipeline, Pipeline, Stage
from pdflow.messages import Route, TextDelta
from pdflow.testing.local_http import openai_client
from pdflow.testing.server import free_port_base

pytestmark = pytest.mark.e2e
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class Gate(Stage):
    """Passes the text on; raises while ``armed`` (a handler that fails)."""

    kind = "gate"
    outputs = {"text": "ingress"}
    stateless = True
    armed = False

    def handlers(self):
        return {TextDelta: self.on_text}

    async def on_text(self, delta: TextDelta) -> None:
        if self.armed:
            Gate.raised_at = time.monotonic()
            raise RuntimeError("the gate is armed")
        await self.send_output("text", Route(), delta)


@pytest.fixture(scope="module")
def running(model_dir):
    # with an egress stage (the default has none: ingress detokenizes), so that the gate sits between it and ingress
    pipeline = Pipeline.default().with_egress().with_stage("gate", Gate, after="egress", output="text")
    loop = asyncio.new_event_loop()
    local = LocalPipeline(pipeline.with_ports(free_port_base()), model_dir=model_dir)
    loop.run_until_complete(local.start())
    local.sent = []
    local.hub.tap = lambda stage, replica, message: local.sent.append((stage, message))
    local.loop = loop
    yield local
    loop.run_until_complete(local.stop())
    loop.close()


def _client(running) -> openai.AsyncOpenAI:
    return openai_client(running.url, asynchronous=True, timeout=120)


def _tables(running) -> dict[str, dict]:
    """What every stage still holds, in its request table and beside it."""
    out = {}
    for (name, replica), stage in running.stages.items():
        sizes = dict(stage.requests.sizes())
        sizes.pop("ended")  # remembered for a while on purpose, bounded
        if name == "decode":
            sizes.update(regions=len(stage.by_region), waiting=len(stage.waiting), running=len(stage.running),
                         batch=len(stage.batch))
        if name == "kv_shuttle":
            stats = stage.store.stats()
            sizes.update(leases=stats.leases, leased=stats.leased_blocks,
                         writing=stats.blocks_used - stats.blocks_cached)
        if name == "prefill":
            sizes.update(queued=stage.queue.qsize(), prefixes=len(stage.by_region))
        if name == "ingress":
            sizes.update(assigned=sum(stage.assigned.values()))
        out[f"{name}-{replica}"] = sizes
    return out


def _settle(running, timeout_s: float = 20) -> dict[str, dict]:
    async def wait():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            tables = _tables(running)
            if all(v == 0 for sizes in tables.values() for v in sizes.values()):
                return tables
            await asyncio.sleep(0.1)
        return _tables(running)

    return running.loop.run_until_complete(wait())


def test_openai_client_against_an_in_process_pipeline(running):
    async def ask():
        return await _client(running).chat.completions.create(
            model="smollm2", messages=FRANCE, temperature=0, max_tokens=20)

    reply = running.loop.run_until_complete(ask())
    assert "Paris" in reply.choices[0].message.content
    assert all(v == 0 for sizes in _settle(running).values() for v in sizes.values())


def test_stop_string_on_the_first_token_leaves_every_table_empty(running):
    async def ask():
        reply = await _client(running).chat.completions.create(
            model="smollm2", messages=FRANCE, temperature=0, max_tokens=20, stop=["The"])
        return reply.choices[0]

    for _ in range(3):
        choice = running.loop.run_until_complete(ask())
        assert (choice.message.content, choice.finish_reason) == ("", "stop")
    tables = _settle(running)
    assert all(v == 0 for sizes in tables.values() for v in sizes.values()), tables


def test_cancel_during_prefill_sends_no_prefill_done_and_leaves_every_table_empty(running):
    long_prompt = "Tell me about the history of every European capital city. " * 60

    prefill = running.stage("prefill")

    async def ask_and_leave() -> str:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            request = http.post("/v1/completions", json={"model": "smollm2", "prompt": long_prompt, "max_tokens": 8})
            task = asyncio.ensure_future(request)
            while not prefill.requests.active:  # prefill holds it: leave 0.2 s into its forward pass
                await asyncio.sleep(0.01)
            (request_id,) = prefill.requests.active
            await asyncio.sleep(0.2)  # prefill of ~720 tokens takes seconds here
            task.cancel()
        return request_id

    del running.sent[:]
    request_id = running.loop.run_until_complete(ask_and_leave())
    tables = _settle(running, timeout_s=60)
    assert all(v == 0 for sizes in tables.values() for v in sizes.values()), tables
    assert prefill.requests.is_over(request_id)
    about_it = [(stage, type(m).__name__) for stage, m in running.sent if getattr(m, "request_id", None) == request_id]
    assert ("prefill", "Cancel") in about_it  # the client left, and ingress told prefill
    # the cancel came during the prefill (no first token went out), and nothing followed it
    assert ("egress", "Tokens") not in about_it and ("decode", "PrefillDone") not in about_it, about_it


def test_a_handler_exception_reaches_the_client_at_once(running):
    async def ask():
        with pytest.raises(openai.APIStatusError) as error:
            await _client(running).chat.completions.create(
                model="smollm2", messages=FRANCE, temperature=0, max_tokens=40)
        return time.monotonic() - Gate.raised_at, error.value

    Gate.armed = True
    try:
        elapsed, error = running.loop.run_until_complete(ask())
    finally:
        Gate.armed = False
    assert error.status_code == 503 and "the gate is armed" in str(error)
    # from the moment the handler raised to the client holding the error: at once, not after the
    # request timeout (300 s; the bound leaves room for a loaded machine: the suite runs in workers)
    assert elapsed < 5.0, elapsed
    assert all(v == 0 for sizes in _settle(running).values() for v in sizes.values())


def test_a_corrupt_block_in_the_store_is_recomputed_and_counted(running):
    """A stored block whose bytes changed fails its checksum when a request would read it: the
    request still gets the same answer (prefill computes that block again), the failure is
    counted, and the block is stored afresh for the next request."""
    document = "The Varenne rises in the granite hills of the Oberland plateau and runs west to the sea. " * 12
    messages = [{"role": "user", "content": document + "Where does the Varenne rise?"}]
    store = running.stage("kv_shuttle").store

    async def ask():
        reply = await _client(running).chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=12)
        return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens

    before = set(store._index)
    first, cached = running.loop.run_until_complete(ask())
    assert cached == 0
    _settle(running)
    chain = [block for block_id, block in store._index.items() if block_id not in before]
    root = next(block for block in chain if block.parent is None)
    second, cached = running.loop.run_until_complete(ask())
    assert second == first and cached >= 192
    _settle(running)
    failures = store.stats().checksum_failures
    victim = next(block for block in chain if block.parent is root)
    store.blocks[7, 1, victim.slot, 3, 1, 5] += 1.0  # one float of the second block's values, layer 7
    third, cached = running.loop.run_until_complete(ask())
    assert third == first
    assert cached == 64, "the hit must end before the corrupt second block"
    assert store.stats().checksum_failures == failures + 1
    _settle(running)
    fourth, cached = running.loop.run_until_complete(ask())
    assert fourth == first and cached >= 192  # recomputed and stored again
    assert all(v == 0 for sizes in _settle(running).values() for v in sizes.values())
