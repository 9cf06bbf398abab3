"""The scaler's policy on its own (pdflow.runtime.scaler), and its settings in a topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdflow.config.pipeline import ScalerConfig
from pdflow.config.topology import TopologyError, parse_topology
from pdflow.runtime.scaler import Load, Scaler, StageLoad

CONFIG = ScalerConfig(interval_s=1, ttft_slo_ms=1000, tbt_slo_ms=100, prefill_queue_per_replica=2,
                      decode_queue_per_replica=8, up_after_s=3, down_after_s=10, cooldown_s=5)


def _load(prefill: tuple[int, int] = (1, 0), decode: tuple[int, int] = (1, 0), ttft: float | None = None,
          tbt: float | None = None) -> Load:
    return Load({"prefill": StageLoad("prefill", *prefill, 1, 4), "decode": StageLoad("decode", *decode, 1, 4)},
                ttft, tbt)


def _run(scaler: Scaler, load: Load, start: float, end: float) -> list[tuple[float, str, int]]:
    changes = []
    t = start
    while t <= end:
        changes += [(t, stage, step) for stage, (step, _) in scaler.decide(load, t).items()]
        t += 1
    return changes


def test_a_hot_stage_grows_only_after_it_stayed_hot_and_then_waits_out_the_cooldown():
    scaler = Scaler(CONFIG)
    hot = _load(decode=(1, 20))  # 20 sequences on one decode replica, bound 8
    assert _run(scaler, hot, 0, 2) == []  # hot for 2 s < up_after_s
    assert _run(scaler, hot, 3, 3) == [(3, "decode", 1)]
    assert _run(scaler, _load(decode=(2, 20)), 4, 7) == []  # cooling down (5 s)
    assert _run(scaler, _load(decode=(2, 20)), 8, 12) == [(11, "decode", 1)]  # hot again from 8: 8 + 3


def test_a_flicker_of_load_resets_the_hysteresis():
    scaler = Scaler(CONFIG)
    assert _run(scaler, _load(decode=(1, 20)), 0, 2) == []
    assert _run(scaler, _load(decode=(1, 4)), 3, 3) == []  # not hot for a moment
    assert _run(scaler, _load(decode=(1, 20)), 4, 6) == []  # hot since 4 only
    assert _run(scaler, _load(decode=(1, 20)), 7, 7) == [(7, "decode", 1)]


def test_latency_past_the_slo_grows_the_stage_that_answers_for_it():
    scaler = Scaler(CONFIG)
    changes = _run(scaler, _load(ttft=1.5, tbt=0.05), 0, 3)  # TTFT over its SLO, TBT well under
    assert changes == [(3, "prefill", 1)]
    scaler = Scaler(CONFIG)
    assert _run(scaler, _load(ttft=0.2, tbt=0.15), 0, 3) == [(3, "decode", 1)]


def test_a_quiet_stage_shrinks_after_down_after_s_but_never_below_its_floor_or_past_its_ceiling():
    scaler = Scaler(CONFIG)
    quiet = _load(prefill=(3, 1), decode=(2, 3), ttft=0.1, tbt=0.02)
    changes = _run(scaler, quiet, 0, 10)
    assert changes == [(10, "prefill", -1), (10, "decode", -1)]
    assert _run(Scaler(CONFIG), _load(prefill=(1, 0), decode=(1, 0)), 0, 30) == []  # at the floor
    assert _run(Scaler(CONFIG), _load(decode=(4, 100)), 0, 30) == []  # at the ceiling
    # one fewer must be able to carry the load: 6 sequences on 2 replicas would be 6 on one (>= 8 / 2)
    assert _run(Scaler(CONFIG), _load(decode=(2, 6), tbt=0.01), 0, 30) == []
    # latency between half the SLO and the SLO: neither hot nor cold
    assert _run(Scaler(CONFIG), _load(decode=(2, 0), tbt=0.07), 0, 30) == []


def test_the_reason_is_given_in_words():
    scaler = Scaler(CONFIG)
    scaler.decide(_load(ttft=2.5), 0)
    (step, why), = scaler.decide(_load(ttft=2.5), 3).values()
    assert step == 1 and why == "TTFT p90 2500 ms > SLO 1000 ms"


def test_scaler_settings_and_bounds_in_a_topology():
    base = Path(__file__).parents[1] / "topology.toml"
    text = base.read_text()
    scaled = parse_topology(text.replace("[stages.decode]\nreplicas = 1", "[stages.decode]\nreplicas = 4\n"
                                         "min_replicas = 2", 1).replace("cooldown_s = 10.0", "cooldown_s = 30", 1), base)
    decode = scaled.stages["decode"]
    assert decode.scaled and decode.floor == 2 and decode.replicas == 4 and scaled.scaler.cooldown_s == 30
    assert not scaled.stages["prefill"].scaled and scaled.stages["prefill"].floor == 1
    for bad, message in (
        ("[stages.decode]\nreplicas = 2\nmin_replicas = 3", "stages.decode.min_replicas: expected an integer >= 1 and <= 2"),
        ("[stages.kv_shuttle]\nreplicas = 2\nmin_replicas = 1", "the scaler starts and stops prefill and decode"),
    ):
        stage = bad.split("\n")[0]
        with pytest.raises(TopologyError, match=message):
            parse_topology(text.replace(f"{stage}\nreplicas = 1", bad, 1), base)
    with pytest.raises(TopologyError, match=r"scaler.up_after_s: expected a number > 0"):
        parse_topology(text.replace("up_after_s = 3.0", "up_after_s = -1", 1), base)
    with pytest.raises(TopologyError, match=r"scaler.cooldown: unknown key 'cooldown'; did you mean 'cooldown_s'"):
        parse_topology(text.replace("cooldown_s = 10.0", "cooldown = 1", 1), base)
