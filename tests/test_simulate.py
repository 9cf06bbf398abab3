"""The simulator: a request's times computed by hand from the profile, FIFO prefill and joins at
step boundaries, prefix reuse priced as the profile says, pdflow's own routers (a custom one
too) and scaler deciding, and the command."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from pdflow import cli
from pdflow.config.pipeline import ScalerConfig
from pdflow.plan.transfer import transfer
from pdflow.routing import ReplicaStatus, Router, RoutingRequest
from pdflow.simulate.cluster import Deployment
from pdflow.simulate.profile import Profile
from pdflow.simulate.run import capacity, simulate
from pdflow.simulate.workload import SimRequest, TracePrompt, from_trace, synthetic

ROOT = Path(__file__).parent.parent
EXCERPT = Path(__file__).parent / "data" / "conversation_trace_excerpt.jsonl"
PROFILE = {"name": "test", "layers": 10, "kv_bytes_per_token": 1000,
           "prefill": {"tokens": [100, 1000], "seconds": [0.1, 2.0]},
           "decode": {"batch": [1, 4], "context": [100, 1100], "seconds": [[0.01, 0.02], [0.03, 0.06]]},
           "link": {"gbit_per_s": 0.001, "latency_s": 0.001}, "max_batch": 4}


@pytest.fixture
def profile() -> Profile:
    return Profile.from_dict(PROFILE)


def request(n: int, at: float, tokens: int = 200, out: int = 5, ids: list[int] | None = None) -> SimRequest:
    return SimRequest(n, at, tokens, out, ids if ids is not None else [1000 + 10 * n + k for k in range(tokens // 100)])


def test_the_profile_interpolates_and_names_what_is_wrong(profile):
    assert profile.full_prefill_s(100) == 0.1 and profile.full_prefill_s(550) == pytest.approx(0.1 + 1.9 * 0.5)
    assert profile.full_prefill_s(50) == pytest.approx(0.05) and profile.full_prefill_s(1900) == pytest.approx(3.9)
    assert profile.prefill_s(100, 500) == pytest.approx(profile.full_prefill_s(600) - profile.full_prefill_s(500))
    assert profile.decode_step_s(1, 100) == 0.01 and profile.decode_step_s(4, 1100) == 0.06
    assert profile.decode_step_s(2, 600) == pytest.approx((0.01 + 0.01 / 3 + 0.03 + 0.03 / 3) / 2)
    staged = Profile.from_dict({**PROFILE, "pipeline": {"prefill_overhead_s": 0.05, "decode_overhead_s": 0.002}})
    assert staged.prefill_s(100) == pytest.approx(0.15) and staged.decode_step_s(1, 100) == pytest.approx(0.012)
    assert Profile.from_dict(staged.to_dict()) == staged
    with pytest.raises(ValueError, match="missing key 'layers'"):
        Profile.from_dict({k: v for k, v in PROFILE.items() if k != "layers"})
    with pytest.raises(ValueError, match="prefill.tokens must be positive and rising"):
        Profile.from_dict({**PROFILE, "prefill": {"tokens": [1000, 100], "seconds": [1, 2]}})


def test_one_request_takes_what_the_profile_says(profile):
    r = request(0, 1.0, tokens=200, out=5)
    outcome = simulate([r], profile, Deployment(block_tokens=100))
    prefill = profile.prefill_s(200)
    tail = transfer(200 * 1000, 10, 0.001, prefill, 0.001).streamed_tail_s
    assert r.first_token_s == pytest.approx(1.0 + prefill)  # prefill sends it
    assert r.kv_in_s == pytest.approx(1.0 + prefill + tail)
    step = profile.decode_step_s(1, 201 + 4 / 2)
    # the first gap waits for the KV tail, then decode's first step
    assert r.gaps == pytest.approx([tail + step] + [step] * 3) and r.done_s == pytest.approx(r.kv_in_s + 4 * step)
    m = outcome.metrics
    assert m["completed"] == 1 and m["ttft_ms"]["p50"] == pytest.approx((r.first_token_s - 1.0) * 1000)
    assert m["output_tokens"] == 5 and m["tbt_ms"]["count"] == 4
    one = request(1, 1.0, tokens=200, out=1)  # done at prefill, with its first token: decode never has it
    simulate([one], profile, Deployment(block_tokens=100))
    assert one.first_token_s == one.done_s == pytest.approx(1.0 + prefill)
    assert one.kv_in_s is None and one.gaps == []


def test_prefill_is_first_come_first_served_and_decode_joins_at_a_step_boundary(profile):
    a, b = request(0, 0.0, out=400), request(1, 0.0, out=5)  # a decodes until after b's KV is in
    simulate([a, b], profile, Deployment(block_tokens=100))
    prefill = profile.prefill_s(200)
    tail = transfer(200 * 1000, 10, 0.001, prefill, 0.001).streamed_tail_s
    assert a.first_token_s == pytest.approx(prefill) and a.kv_in_s == pytest.approx(prefill + tail)
    assert b.first_token_s == pytest.approx(2 * prefill)  # b's prefill waited for a's
    # and its KV for a's on the links (200 KB at 125 KB/s each: the links, not prefill, are the
    # bottleneck here)
    assert 2 * prefill + tail < a.kv_in_s + 1.6
    assert b.kv_in_s == pytest.approx(a.kv_in_s + 200 * 1000 / 125_000)
    alone = a.gaps[1]
    assert a.gaps[0] == pytest.approx(tail + alone)
    boundary = a.kv_in_s + math.ceil((b.kv_in_s - a.kv_in_s) / alone - 1e-9) * alone  # a's steps began at its KV
    joined = round((boundary - a.kv_in_s) / alone)
    assert a.gaps[1:joined] == pytest.approx([alone] * (joined - 1))
    together = a.gaps[joined]
    assert together > alone  # a batch of two steps slower
    # b's first gap: from its first token, through its KV's wait and the step boundary, to the
    # end of the first step it is in
    assert b.gaps[0] == pytest.approx(boundary + together - b.first_token_s)
    assert all(r.done_s is not None and len(r.gaps) == r.output_len - 1 for r in (a, b))


def test_transfers_share_a_replica_s_link_and_not_another_s(profile):
    """Two prompts at once on two prefill replicas: into two decode replicas their KV moves side by
    side; into one, the second waits for the first on decode's link (1.6 s each at 125 KB/s)."""
    a, b = request(0, 0.0), request(1, 0.0)
    simulate([a, b], profile, Deployment(prefill=2, decode=2, block_tokens=100))
    apart = a.kv_in_s
    assert b.kv_in_s == pytest.approx(apart) and a.route[2] != b.route[2]
    simulate([a, b], profile, Deployment(prefill=2, decode=1, block_tokens=100))
    assert sorted([a.kv_in_s, b.kv_in_s]) == pytest.approx([apart, apart + 1.6])
    assert a.first_token_s == pytest.approx(b.first_token_s)  # each prefill sends its own at its end


def test_a_central_store_carries_every_byte_twice_and_a_store_beside_prefill_once(profile):
    """Two prompts at once on two prefill hosts into two decode hosts (no prefix: 200 KB of KV
    each, 1.6 s a link at 125 KB/s). Through one central store host, the store's NIC carries both
    in and both out: the second waits for the first there, and twice the KV crosses the network
    (cut-through, the first is in as soon as it would be over one link). With a store beside each
    prefill, each request's KV leaves its prefill host once and the two move side by side."""
    profile = Profile.from_dict({**PROFILE, "link": {"gbit_per_s": 0.001, "latency_s": 0.0}})
    a, b = request(0, 0.0), request(1, 0.0)
    outcome = simulate([a, b], profile, Deployment(prefill=2, decode=2, stores=1, block_tokens=100,
                                                   placement="central"))
    net = outcome.metrics["network"]
    assert net["kv_crossings"] == pytest.approx(2.0) and net["prompt_kv_bytes"] == 400_000
    assert net["busiest_nic"]["store"] > net["busiest_nic"]["prefill"]
    central = sorted([a.kv_in_s, b.kv_in_s])
    assert central[1] - central[0] == pytest.approx(1.6)  # one after the other through the store's NIC
    for placement in ("beside", "direct"):
        outcome = simulate([a, b], profile, Deployment(prefill=2, decode=2, block_tokens=100, placement=placement))
        assert outcome.metrics["network"]["kv_crossings"] == pytest.approx(1.0)
        assert a.kv_in_s == pytest.approx(b.kv_in_s) == pytest.approx(central[0])
        assert [r.route[0] for r in (a, b)] == [r.route[1] for r in (a, b)]  # each prefill writes the store beside it
    with pytest.raises(ValueError, match="stores must equal prefill replicas"):
        simulate([a], profile, Deployment(prefill=2, stores=1, placement="beside"))
    with pytest.raises(ValueError, match="placement must be one of central, beside, direct"):
        simulate([a], profile, Deployment(placement="rack"))


def test_a_prefix_in_the_store_is_read_and_only_the_rest_computed(profile):
    """The store sends the prefix to prefill (over the profile's slow link here: 500 KB at 125 KB/s
    is 4 s), which computes each layer once its part of the prefix is in: the last layer's wait
    plus one layer's compute; then decode's KV tail."""
    first = request(0, 0.0, tokens=500, ids=[1, 2, 3, 4, 5])
    again = request(1, 100.0, tokens=600, ids=[1, 2, 3, 4, 5, 6])
    simulate([first, again], profile, Deployment(block_tokens=100))
    assert again.cached_tokens == 500
    compute = profile.prefill_s(100, 500)
    prefill = 0.001 + 4.0 + compute / 10  # the prefix is the slower: its last layer, then that layer's compute
    tail = transfer(600 * 1000, 10, 0.001, prefill, 0.001).streamed_tail_s
    assert again.kv_in_s == pytest.approx(100.0 + prefill + tail)
    assert again.first_token_s == pytest.approx(100.0 + prefill)
    fast = Profile.from_dict({**PROFILE, "link": {"gbit_per_s": 1000, "latency_s": 0}})
    simulate([first, again], fast, Deployment(block_tokens=100))  # 4 us of prefix: compute is the slower
    prefill = 4e-6 / 10 + compute  # (the first layer's wait, then every layer's compute)
    tail = 100 * 1000 / 125e9 / 10  # prefill sends the 100 tokens it computed: their last layer after it ends
    assert again.kv_in_s - 100.0 == pytest.approx(prefill + tail)
    # a prefix that lands while its request waits in prefill's queue costs it nothing more
    second = Profile.from_dict({**PROFILE, "link": {"gbit_per_s": 0.004, "latency_s": 0}})  # 1 s of prefix
    ahead = request(2, 100.0, tokens=900, ids=list(range(50, 59)))  # 1.81 s of prefill first
    simulate([first, ahead, again], second, Deployment(block_tokens=100))
    end = 100.0 + second.prefill_s(900) + compute  # again's prefill: only its compute, the prefix was in
    ahead_sent = 100.0 + max(second.prefill_s(900) + 0.18, second.prefill_s(900) / 10 + 1.8)  # 900 KB at 500 KB/s
    # again's 600 KB then follow on the same links, from when ahead's are out
    assert again.kv_in_s == pytest.approx(max(end + 0.12, max(end - compute + compute / 10, ahead_sent) + 1.2))
    assert again.first_token_s == pytest.approx(end)
    last_token = request(2, 200.0, tokens=500, ids=[1, 2, 3, 4, 5])  # never the prompt's last token
    simulate([first, last_token], profile, Deployment(block_tokens=100))
    assert last_token.cached_tokens == 400


def test_gap_ratios_stretch_decode_s_steps_while_the_prefill_beside_it_computes():
    """With measured gap ratios (here: every gap twice the step beside a prefill, the step without
    one), a running answer's steps take twice as long from the step boundary after another prompt's
    prefill starts to the one after it ends; a seed fixes the draws of a spread distribution."""
    flat = {**PROFILE, "link": {"gbit_per_s": 1000, "latency_s": 0},
            "decode": {"batch": [1, 4], "context": [100, 1100], "seconds": [[0.01, 0.02], [0.01, 0.02]]}}
    profile = Profile.from_dict({**flat, "pipeline": {"decode_gap_ratios": {"busy": [2.0] * 101, "idle": [1.0] * 101}}})
    assert Profile.from_dict(profile.to_dict()) == profile
    a, b = request(0, 0.0, out=400), request(1, 1.0, out=2)
    simulate([a, b], profile, Deployment(block_tokens=100))
    start, end = 1.0, b.first_token_s  # b's prefill
    assert end == pytest.approx(1.0 + profile.prefill_s(200))
    t, seen = a.first_token_s, set()
    for gap in a.gaps[1:]:
        t0, t = t, t + gap
        if t < start:
            assert gap == pytest.approx(0.01)  # alone, nothing prefilling
        elif t0 >= start + 0.01 and t <= end:
            assert gap == pytest.approx(0.02)  # beside b's prefill
        elif t0 >= b.done_s:
            assert gap == pytest.approx(0.01)  # b came and went
        seen.add(round(gap, 4))
    assert {0.01, 0.02} <= seen
    spread = Profile.from_dict({**flat, "pipeline": {"decode_gap_ratios": {
        "busy": [1 + i / 50 for i in range(101)], "idle": [0.9 + i / 500 for i in range(101)]}}})
    assert spread.gap_ratio(True, 0.5) == pytest.approx(2.0) and spread.gap_ratio(False, 1.0) == pytest.approx(1.1)
    one = simulate([a, b], spread, Deployment(block_tokens=100), seed=3).metrics
    assert simulate([a, b], spread, Deployment(block_tokens=100), seed=3).metrics == one
    assert simulate([a, b], spread, Deployment(block_tokens=100), seed=4).metrics != one
    assert all(0.009 - 1e-9 <= g <= 0.03 + 1e-9 for g in a.gaps[1:])
    with pytest.raises(ValueError, match="decode_gap_ratios"):
        Profile.from_dict({**flat, "pipeline": {"decode_gap_ratios": {"busy": [2.0, 1.0]}}})
    with pytest.raises(ValueError, match="decode_gap_ratios"):
        Profile.from_dict({**flat, "pipeline": {"decode_gap_ratios": {"sometimes": [1.0, 2.0]}}})


def test_a_store_that_holds_little_evicts_the_least_recently_used(profile):
    requests = [request(0, 0.0, 300, ids=[1, 2, 3]), request(1, 10.0, 300, ids=[7, 8, 9]),
                request(2, 20.0, 400, ids=[1, 2, 3, 4])]
    simulate(requests, profile, Deployment(block_tokens=100, store_blocks=3))
    assert requests[2].cached_tokens == 0  # 1-3 went when 7-9 came
    simulate(requests, profile, Deployment(block_tokens=100, store_blocks=6))
    assert requests[2].cached_tokens == 300


def conversations(count: int = 7, turns: int = 5) -> list[SimRequest]:
    """``count`` chats of ``turns`` turns, interleaved: turn t re-sends the history (2 blocks a
    turn) and adds one block."""
    requests = []
    for t in range(turns):
        for c in range(count):
            ids = [c * 1000 + k for k in range(2 * t + 2)]
            requests.append(SimRequest(len(requests), 10.0 * t + 0.5 * c, 100 * len(ids), 4, ids))
    return requests


def test_cache_aware_routing_keeps_conversations_where_their_kv_is():
    profile = Profile.from_dict({**PROFILE, "link": {"gbit_per_s": 100}})
    requests = conversations()
    deploy = Deployment(prefill=2, decode=2, block_tokens=100)
    spread = simulate(requests, profile, deploy, "round_robin").metrics["cache"]["hit_ratio"]
    aware = simulate(requests, profile, deploy, "cache_aware", {"fetch_tokens_per_s": 0}).metrics["cache"]["hit_ratio"]
    fetching = simulate(requests, profile, deploy, "cache_aware").metrics
    assert aware > spread and fetching["cache"]["hit_ratio"] >= aware
    assert fetching["completed"] == 35
    simulate(requests, profile, deploy, "cache_aware", {"fetch_tokens_per_s": 0})
    placed = {}  # each chat stays on one store from its second turn on (7 chats: round robin alternates)
    for r in requests[7:]:
        placed.setdefault(r.hash_ids[0], set()).add(r.route[1])
    assert all(len(s) == 1 for s in placed.values()), placed


class HighestRouter(Router):
    """Every stage's highest-numbered replica."""

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        return max(r.replica for r in replicas)


def test_any_router_decides_as_it_would_in_pdflow(profile):
    requests = [request(n, n * 0.1) for n in range(6)]
    simulate(requests, profile, Deployment(prefill=3, decode=2, block_tokens=100), HighestRouter)
    assert {r.route for r in requests} == {(2, 2, 1)}
    assert len(TracePrompt([5, 6], 150, 100)) == 150 and TracePrompt([5, 6], 150, 100)[101] == 601


def test_the_scaler_adds_prefill_under_a_burst_and_parks_it_after():
    profile = Profile.from_dict({**PROFILE, "link": {"gbit_per_s": 100, "latency_s": 0.001}})  # prefill-bound
    burst = synthetic(60, rate=20, input_len=300, output_len=3, seed=1)
    # then one every 5 s: prefill idle for 4.5 s between them, past down_after_s
    quiet = [SimRequest(60 + n, burst[-1].arrival_s + 30 + 5 * n, 300, 3, [5 * 10**8 + n]) for n in range(20)]
    scaler = ScalerConfig(interval_s=0.5, window_s=3, prefill_queue_per_replica=2, decode_queue_per_replica=100,
                          ttft_slo_ms=60000, tbt_slo_ms=60000, up_after_s=1, down_after_s=3, cooldown_s=2)
    outcome = simulate(burst + quiet, profile, Deployment(prefill=3, decode=1, block_tokens=100, min_prefill=1),
                       scaler=scaler)
    running = [p for _, p, _ in outcome.replicas]
    assert running[0] == 1 and max(running) == 3 and running[-1] == 1
    fixed = simulate(burst + quiet, profile, Deployment(prefill=1, decode=1, block_tokens=100))
    assert outcome.metrics["ttft_ms"]["p90"] < fixed.metrics["ttft_ms"]["p90"]
    assert outcome.metrics["completed"] == 80


def test_the_command_runs_a_trace_and_a_sweep(capsys, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    out = tmp_path / "runs.json"
    assert cli.main(["simulate", "--profile", str(path), "--trace", str(EXCERPT), "--token-scale", "0.05",
                     "--sweep", "1:1", "2:1", "--slo-ttft", "5000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pdflow simulate: 1P:1D" in text and "P:D" in text
    runs = json.loads(out.read_text())["runs"]
    assert [(r["prefill"], r["decode"]) for r in runs] == [(1, 1), (2, 1)]
    assert runs[1]["metrics"]["ttft_ms"]["p50"] <= runs[0]["metrics"]["ttft_ms"]["p50"]
    assert cli.main(["simulate", "--profile", str(path)]) == 2
    assert "--trace FILE or --synthetic N" in capsys.readouterr().err
    assert cli.main(["simulate", "--profile", str(path), "--trace", str(EXCERPT), "--token-scale", "0.05",
                     "--prefill", "2", "--placement", "central", "--stores", "1", "--nic-gbit", "0.01",
                     "--json", str(out)]) == 0
    assert "network (central):" in capsys.readouterr().out
    network = json.loads(out.read_text())["runs"][0]["metrics"]["network"]
    assert network["placement"] == "central" and 1.5 < network["kv_crossings"] <= 2.0 + 1e-9  # (one-token answers: to the store only)
    assert cli.main(["simulate", "--profile", str(path), "--synthetic", "2", "--prefill", "2", "--stores", "1",
                     "--placement", "beside"]) == 2
    assert "stores must equal prefill replicas" in capsys.readouterr().err


def test_the_shipped_profiles_load():
    for path in (ROOT / "profiles").glob("*.json"):
        profile = Profile.load(path)
        assert profile.source, path


def test_a_trace_is_replayed_faster_and_smaller_keeping_its_blocks():
    plain, scaled = from_trace(str(EXCERPT)), from_trace(str(EXCERPT), speed=2, token_scale=0.25)
    assert len(plain) == len(scaled) == 40
    assert [r.arrival_s / 2 for r in plain] == pytest.approx([r.arrival_s for r in scaled])
    assert all(s.input_len == max(1, round(p.input_len / 4)) and s.hash_ids == p.hash_ids
               for p, s in zip(plain, scaled))
    with pytest.raises(ValueError, match="speed and token_scale must be > 0"):
        from_trace(str(EXCERPT), speed=0)


# --- colocated workers ----------------------------------------------------------------------

def test_a_colocated_worker_alone_prefills_then_decodes(profile):
    """As the worker: the prefill, then one step with the prompt in the batch, and only then its
    first token, with its second (no gap between them); then steps back to back."""
    r = request(0, 1.0, tokens=200, out=5)
    simulate([r], profile, Deployment(mode="colocated", block_tokens=100))
    first_step = profile.decode_step_s(1, 201)
    assert r.first_token_s == pytest.approx(1.0 + profile.prefill_s(200) + first_step)  # no link
    step = profile.decode_step_s(1, 202 + 3 / 2)
    assert r.gaps == pytest.approx([0.0] + [step] * 3)


@pytest.mark.parametrize("chunk", [0, 100])
def test_a_prompt_arriving_stalls_the_running_batch_for_its_prefill_or_one_chunk(profile, chunk):
    a = request(0, 0.0, tokens=100, out=200)
    b = request(1, 1.0, tokens=900, out=3, ids=list(range(50, 59)))
    simulate([a, b], profile, Deployment(mode="colocated", block_tokens=100, chunked_prefill_tokens=chunk))
    stall = max(a.gaps)
    whole = profile.prefill_s(900)
    if chunk == 0:  # one gap holds b's whole prefill and a step
        assert stall == pytest.approx(whole + profile.decode_step_s(2, a.gaps.index(stall) + 101), rel=0.05)
    else:  # no gap holds more than one 100-token chunk and a step
        assert stall < whole / 3
        assert b.first_token_s - 1.0 > whole  # b took longer: its chunks shared the loop with a's steps
    assert a.done_s is not None and len(a.gaps) == 199 and len(b.gaps) == 2 and b.gaps[0] == 0.0


def test_a_colocated_worker_reuses_its_own_store(profile):
    first, again = request(0, 0.0, 500, ids=[1, 2, 3, 4, 5]), request(1, 50.0, 600, ids=[1, 2, 3, 4, 5, 6])
    simulate([first, again], profile, Deployment(mode="colocated", workers=2, block_tokens=100), "cache_aware")
    assert again.cached_tokens == 500 and again.route == first.route
    assert again.first_token_s - 50.0 == pytest.approx(profile.prefill_s(100, 500) + profile.decode_step_s(1, 601))
    with pytest.raises(ValueError, match="not with mode = 'colocated'"):
        Deployment(mode="colocated", min_prefill=1)


def test_the_command_simulates_the_colocated_baseline(capsys, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    assert cli.main(["simulate", "--profile", str(path), "--synthetic", "20", "--rate", "0.5", "--input", "300",
                     "--output", "8", "--mode", "colocated", "--workers", "2", "--chunked-prefill-tokens", "128"]) == 0
    assert "2 workers (colocated)" in capsys.readouterr().out
    assert cli.main(["simulate", "--profile", str(path), "--synthetic", "2", "--mode", "colocated",
                     "--sweep", "1:1"]) == 2
    assert "--sweep is for P:D splits" in capsys.readouterr().err


def test_pdflow_profile_measures_a_profile_the_simulator_loads(tmp_path, model_dir, capsys):
    from pdflow.simulate.measure import tcp_gbit_per_s

    assert tcp_gbit_per_s(chunk=1 << 16, count=8) > 0
    out = tmp_path / "here.json"
    rc = cli.main(["profile", "--out", str(out), "--prefill", "16", "32", "--batch", "1", "2", "--context", "16",
                   "--steps", "2", "--link-gbit", "10"])
    assert rc == 0, capsys.readouterr().err
    measured = Profile.load(out)
    assert measured.prefill_tokens == [16, 32] and measured.decode_batch == [1, 2] and measured.layers == 30
    assert measured.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2's fp32 KV
    assert "1 torch thread" in measured.source and measured.link_gbit_per_s == 10
    r = request(0, 0.0, tokens=24, out=3)
    simulate([r], measured, Deployment(block_tokens=16))
    assert r.done_s is not None


def test_an_answer_s_gaps_are_measured_beside_prefills_and_without(default_server):
    """``pdflow profile --pipeline``'s gap ratios, through a real pipeline: an answer streams while
    a prompt prefills; every gap but its first is counted once, as beside a prefill or not."""
    import asyncio

    from pdflow.simulate.measure import gaps_beside_prefills, percentiles

    shipped = Profile.load(ROOT / "profiles" / "cpu-2core-smollm2-int4.json")
    busy, idle = asyncio.run(gaps_beside_prefills(default_server.url, shipped, [256], rounds=1, prompt=16,
                                                  pause_s=0.3, first_id=27_000))
    tokens = int((0.3 + shipped.prefill_s(256) + 0.3 + 0.3) / shipped.decode_step_s(1, 16 + 256)) + 32
    assert 0.9 * (tokens - 2) <= len(busy) + len(idle) <= tokens - 2  # (a token may end mid-character)
    assert busy and idle and min(busy + idle) > 0
    ratios = percentiles(busy)  # as the profile keeps them
    assert len(ratios) == 101 and ratios[0] == pytest.approx(min(busy), abs=1e-4)
    assert ratios[100] == pytest.approx(max(busy), abs=1e-4) and ratios == sorted(ratios)


def test_a_prompt_arriving_while_the_worker_prefills_joins_that_prefill_work(profile):
    """b arrives during a's prefill: the worker reads its queue as it goes, so b is prefilled in
    the same iteration, and a's first token waits for b's prefill and the step they share."""
    a = request(0, 0.0, tokens=900, out=50)
    b = request(1, 0.5, tokens=900, out=3, ids=list(range(50, 59)))
    simulate([a, b], profile, Deployment(mode="colocated", block_tokens=100))
    shared = 2 * profile.prefill_s(900) + profile.decode_step_s(2, 901)
    assert a.first_token_s == pytest.approx(shared) and b.first_token_s == pytest.approx(shared)
    assert a.gaps[0] == b.gaps[0] == 0.0
    # a batch that is full stops the prefill work: c waits for the next iteration
    full = Profile.from_dict({**PROFILE, "max_batch": 1})
    a, c = request(0, 0.0, tokens=900, out=50), request(2, 0.0, tokens=100, out=3, ids=[90])
    simulate([a, c], full, Deployment(mode="colocated", block_tokens=100))
    assert a.first_token_s == pytest.approx(full.prefill_s(900) + full.decode_step_s(1, 901))
    assert c.first_token_s > a.done_s


def test_capacity_is_where_the_share_within_the_slos_falls_through_the_target():
    assert capacity([(20, 0.91), (10, 0.95), (30, 0.80)], 0.9) == (pytest.approx(20 + 10 * 0.01 / 0.11),
                                                                  "between two loads run")
    assert capacity([(10, 0.95), (20, 0.92)])[0] == 20 and "at least" in capacity([(10, 0.95), (20, 0.92)])[1]
    assert capacity([(10, 0.89), (20, 0.5)]) == (None, "below 10.0 (the lowest load run)")
    with pytest.raises(ValueError, match="no runs"):
        capacity([])


def test_the_worker_s_ratios_and_step_extras_stretch_its_iterations(profile):
    """With a measured ratio for the worker's iterations that prefill (here twice the
    prediction) and extras for its steps alone (5 ms at batch 1, 11 ms at batch 3: 2 ms a fixed
    cost and 3 ms a sequence), the first token comes after twice the prefill and the step that
    follows it, every later gap alone is the step and 5 ms, and a prompt arriving mid-answer
    stalls it for twice its prefill and a step, after which both step at batch 2 with 8 ms."""
    stretched = Profile.from_dict({**PROFILE, "pipeline": {"worker_ratios": {"prefill": [2.0] * 101},
                                                           "worker_step_extra_s": {"1": [0.005] * 101,
                                                                                   "3": [0.011] * 101}}})
    assert Profile.from_dict(stretched.to_dict()) == stretched
    assert stretched.worker_ratio(0.3) == 2.0 and profile.worker_ratio(0.3) == 1.0
    assert [stretched.worker_step_extra(b, 0.5) for b in (1, 2, 3, 11)] == pytest.approx([0.005, 0.008, 0.011, 0.035])
    assert profile.worker_step_extra(4, 0.5) == 0.0
    r = request(0, 1.0, tokens=200, out=5)
    simulate([r], stretched, Deployment(mode="colocated", block_tokens=100))
    assert r.first_token_s == pytest.approx(1.0 + 2 * (stretched.prefill_s(200) + stretched.decode_step_s(1, 201)))
    assert r.gaps == pytest.approx([0.0] + [stretched.decode_step_s(1, 202 + 3 / 2) + 0.005] * 3)
    a, b = request(0, 0.0, tokens=100, out=200), request(1, 1.0, tokens=900, out=3, ids=list(range(50, 59)))
    simulate([a, b], stretched, Deployment(mode="colocated", block_tokens=100))
    stall = max(a.gaps)
    at = a.gaps.index(stall)
    assert stall == pytest.approx(2 * (stretched.prefill_s(900) + stretched.decode_step_s(2, at + 101)), rel=0.05)
    assert len(a.gaps) == 199 and b.first_token_s > 1.0 + 2 * stretched.prefill_s(900)
    assert b.gaps == pytest.approx([0.0, stretched.decode_step_s(2, (at + 102 + 902) / 2) + 0.008], rel=0.01)
    assert a.gaps[at + 1] == pytest.approx(b.gaps[1])
    with pytest.raises(ValueError, match="worker_step_extra_s"):  # a step alone's ratio was replaced
        Profile.from_dict({**PROFILE, "pipeline": {"worker_ratios": {"decode": [1.0, 2.0]}}})
    with pytest.raises(ValueError, match="worker_ratios"):
        Profile.from_dict({**PROFILE, "pipeline": {"worker_ratios": {"prefill": [2.0, 1.0]}}})
    with pytest.raises(ValueError, match="batch sizes > 0"):
        Profile.from_dict({**PROFILE, "pipeline": {"worker_step_extra_s": {"0": [0.0, 0.1]}}})
    with pytest.raises(ValueError, match=r"worker_step_extra_s\['4'\] must be rising percentiles"):
        Profile.from_dict({**PROFILE, "pipeline": {"worker_step_extra_s": {"4": [0.1, -0.1]}}})


def test_the_worker_s_iterations_are_measured_through_a_colocated_server(colocated_server):
    """``pdflow profile --worker``: an answer streams through the real worker while a prompt comes
    in; the gap that holds its prefill is found (a prefill is many steps long) and every other gap
    is a step's."""
    import asyncio

    from pdflow.simulate.measure import worker_iterations

    shipped = Profile.load(ROOT / "profiles" / "cpu-2core-smollm2-int4-2threads.json")
    prefill, decode = asyncio.run(worker_iterations(colocated_server.url, shipped, [256, 512], rounds=1, prompt=16,
                                                    pause_s=0.3, first_id=31_000))
    assert len(prefill) == 2 and len(decode) > 20
    step = statistics.median(decode) * shipped.decode_step_s(1, 100)  # a gap that is a step, in seconds
    for n, ratio in zip([256, 512], prefill):  # the gap found holds many steps' time: a prefill's
        assert ratio * (shipped.prefill_s(n) + shipped.decode_step_s(1, 100)) > 5 * step


def test_the_worker_s_steps_are_measured_through_a_colocated_server(colocated_server):
    """``pdflow profile --worker``, its steps alone: two answers stream together through the real
    worker; the first one's gaps while both run (its own first gap, which holds the prefills, left
    out) are steps of batch 2, each returned as its time beyond the profile's step."""
    import asyncio

    from pdflow.simulate.measure import worker_steps

    shipped = Profile.load(ROOT / "profiles" / "cpu-2core-smollm2-int4-2threads.json")
    extra = asyncio.run(worker_steps(colocated_server.url, shipped, 2, tokens=40, prompt=16, rounds=1,
                                     first_id=33_000))
    step = shipped.decode_step_s(2, 40)
    gaps = [step + e for e in extra]
    assert 20 <= len(gaps) <= 38 and min(gaps) > 0
    # a step, not a prefill's many; the bound leaves room for a machine the suite's workers load
    # (a median of 7.6 steps was seen with 3 workers on 2 cores)
    assert 0.2 * step < statistics.median(gaps) < 20 * step
