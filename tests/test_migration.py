"""Migration's seam, on egress alone (a MemoryHub, the real tokenizer): a stream cut after any
token and resumed from the tokens generated so far and the text already sent gives exactly the
text of the uninterrupted stream, stop strings and multi-byte characters across the seam included."""

from __future__ import annotations

import asyncio

import pytest

from pdflow import Pipeline
from pdflow.messages import EgressRequest, Route, TextDelta, Tokens
from pdflow.runtime.memory_bus import MemoryHub
from pdflow.runtime.stage import StageContext
from pdflow.stages.egress import EgressStage

TEXTS = ["The keeper climbed the stairs; the lamp — naïve, 😀 bright — turned. STOP and more text after",
         "Ångström façade: déjà vu 🇫🇷 then the END of it all"]
ROUTE = Route({"ingress": 0, "egress": 0})


@pytest.fixture(scope="module")
def egress_setup(model_dir):
    pipeline = Pipeline.default()
    hub = MemoryHub({"ingress": 1, "egress": 1, "decode": 1}, pipeline.message_types())
    stage = EgressStage(StageContext(pipeline, "egress", 0, model_dir), hub.bus("egress"))
    asyncio.run(stage.setup())
    return stage, hub


async def _run(stage, hub, request: EgressRequest, tokens: list[int], finish: str | None) -> list[TextDelta]:
    ingress = hub.bus("ingress")
    await stage.deliver(request)
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        await stage.deliver(Tokens(request.request_id, i, [token], finish if last else None))
    deltas = []
    while not hub.inbox("ingress", 0).empty():
        deltas.append(await asyncio.wait_for(ingress.recv(), 1))
    while not hub.inbox("decode", 0).empty():
        await hub.bus("decode").recv()  # StopRequests
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [(), ("STOP", "END")])
async def test_a_stream_resumed_after_any_token_gives_the_same_text(egress_setup, text, stop):
    stage, hub = egress_setup
    ids = stage.tokenizer.encode(text)
    whole = await _run(stage, hub, EgressRequest(f"w{stop}{text[:5]}", 3, len(ids), stop, route=ROUTE), ids, "length")
    expected = "".join(d.text for d in whole)
    assert [t for d in whole for t in d.token_ids] == ids[:whole[-1].completion_tokens]
    for cut in range(1, whole[-1].completion_tokens):
        first = await _run(stage, hub, EgressRequest(f"a{cut}{stop}{text[:5]}", 3, len(ids), stop, route=ROUTE),
                           ids[:cut], None)
        sent = "".join(d.text for d in first)
        generated = [t for d in first for t in d.token_ids]
        rest = ids[len(generated):]
        resumed = await _run(stage, hub, EgressRequest(f"b{cut}{stop}{text[:5]}", 3 + len(generated),
                                                       len(ids) - len(generated), stop, route=ROUTE,
                                                       resume_ids=generated, resume_chars=len(sent)), rest, "length")
        assert sent + "".join(d.text for d in resumed) == expected, cut
        assert resumed[-1].completion_tokens == whole[-1].completion_tokens
        assert resumed[-1].finish_reason == whole[-1].finish_reason
