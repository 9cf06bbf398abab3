"""KV-tail arithmetic and trace export on hand-made timelines."""

from __future__ import annotations

import json

import pytest

from pdflow.timeline import chrome_trace, kv_summary, plot


def _timeline(ready_every: float, transfer: float, layers: int = 4, streaming: str = "layer") -> dict:
    done = [0.1 + ready_every * (i + 1) for i in range(layers)]
    landed, link_free = [], 0.0
    for ready in done:
        start = max(ready if streaming == "layer" else done[-1], link_free)
        link_free = start + transfer
        landed.append(link_free)
    send_start = done[0] if streaming == "layer" else done[-1]
    return {"prefill.start": [0.1], "prefill.send_start": [send_start], "prefill.layer_done": done, "prefill.layer_sent": done,
            "decode.layer_in": landed, "decode.joined": [landed[-1]], "decode.steps": [landed[-1] + 0.01]}


def test_layer_streaming_hides_all_but_one_layer_when_the_link_keeps_up():
    s = kv_summary(_timeline(ready_every=0.010, transfer=0.002))
    assert s["kv_tail_s"] == pytest.approx(0.002)
    assert s["whole_transfer_s"] == pytest.approx(0.008)
    assert s["tail_over_one_layer"] == pytest.approx(1.0)
    assert s["hidden_fraction"] == pytest.approx(0.75)


def test_request_streaming_tail_is_the_whole_transfer():
    s = kv_summary(_timeline(ready_every=0.010, transfer=0.002, streaming="request"))
    assert s["kv_tail_s"] == pytest.approx(s["whole_transfer_s"]) == pytest.approx(0.008)
    assert s["hidden_fraction"] == pytest.approx(0.0)


def test_a_slow_link_piles_up_layers():
    s = kv_summary(_timeline(ready_every=0.002, transfer=0.010))
    assert s["tail_over_one_layer"] > 3


def test_chrome_trace_has_every_layer_on_each_lane(tmp_path):
    trace = json.loads(json.dumps(chrome_trace(_timeline(0.01, 0.002), "r-1")))
    for lane in ("compute", "KV transfer"):
        assert sorted(e["args"]["layer"] for e in trace["traceEvents"] if e["tid"] == lane) == [0, 1, 2, 3]
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    pytest.importorskip("matplotlib")
    assert plot(_timeline(0.01, 0.002), tmp_path / "t.png").stat().st_size > 1000
