"""`pdflow bench serve`: metric definitions and the prefix-sharing prompt builder on hand-made
inputs, then short runs against a real `pdflow run` (fixed workload, and a Mooncake trace replay)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from pdflow.bench import plots
from pdflow.bench.metrics import distribution, meets_slo, mooncake_tbt, percentile, summarize, tpot
from pdflow.bench.prompts import PromptBuilder, Tokenizer
from pdflow.bench.serve import main, parse_args, reproduce
from pdflow.bench.serve_client import RequestRecord, send
from pdflow.bench.serve_runner import schedule
from pdflow.bench.cache_bound import infinite_cache_hits
from pdflow.bench.workloads import (
    WorkloadSpec, build, build_sessions, reusable_fraction, shared_prefix_blocks, trace_rows,
)

# Only the tests that start a server carry the e2e mark: the rest are fast unit tests that should
# still run under `-m "not e2e"`.
e2e = pytest.mark.e2e
TRACES = Path(__file__).parent / "data"  # an excerpt of Mooncake's trace (see data/README.md)
DISTRIBUTIONS = ("ttft_ms", "tbt_ms", "tbt_mooncake_ms", "tpot_ms", "e2e_ms")
SCALARS = ("requests", "completed", "failed", "errors", "duration_s", "request_throughput",
           "input_token_throughput", "output_token_throughput", "total_token_throughput", "input_tokens",
           "output_tokens", "slo_ttft_ms", "slo_tbt_ms", "good_requests", "goodput", "goodput_fraction",
           "usage_missing", "chunks_differ_from_usage", "output_len_differs")


# --- metrics on hand-made numbers ---------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    d = distribution([0.001, 0.002, 0.003, 0.010])  # seconds in, ms out
    assert d == pytest.approx({"count": 4, "mean": 4.0, "min": 1.0, "p50": 2.5, "p90": 7.9, "p99": 9.79,
                               "max": 10.0})
    assert distribution([])["p99"] is None


def test_mooncake_tbt_is_the_mean_of_the_longest_tenth():
    assert mooncake_tbt([float(g) for g in range(1, 21)]) == pytest.approx(19.5)  # 2 of 20 gaps
    assert mooncake_tbt([0.1, 0.5, 0.2, 0.1, 0.1, 0.1, 0.1]) == pytest.approx(0.5)  # at least one gap
    assert mooncake_tbt([float(g) for g in range(1, 12)]) == pytest.approx(10.5)  # ceil(1.1) = 2
    assert mooncake_tbt([]) is None


def _record(i, ttft, gaps, tokens, error=None):
    e2e = ttft + sum(gaps)
    return RequestRecord(i, 10, tokens, ttft_s=ttft, gaps_s=gaps, e2e_s=e2e, chunks=len(gaps) + 1,
                         usage_prompt_tokens=10, usage_completion_tokens=tokens, output_tokens=tokens,
                         error=error)


def test_tpot_goodput_and_throughput():
    fast = _record(0, 0.1, [0.01] * 9, 10)
    slow_start = _record(1, 2.0, [0.01] * 9, 10)
    one_stall = _record(2, 0.1, [0.01] * 8 + [1.0], 10)
    failed = RequestRecord(3, 10, 10, error="HTTP 503: busy")
    assert tpot(fast) == pytest.approx(0.01)
    assert meets_slo(fast, 500, 50) and not meets_slo(slow_start, 500, 50)
    assert not meets_slo(one_stall, 500, 50) and meets_slo(one_stall, 500, None)
    m = summarize([fast, slow_start, one_stall, failed], duration_s=4.0, slo_ttft_ms=500, slo_tbt_ms=50)
    assert (m["completed"], m["failed"], m["good_requests"]) == (3, 1, 1)
    assert m["goodput"] == pytest.approx(0.25) and m["goodput_fraction"] == pytest.approx(0.25)
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_token_throughput"] == pytest.approx(7.5)
    assert m["tbt_ms"]["count"] == 27 and m["tbt_mooncake_ms"]["count"] == 3
    assert m["errors"] == ["request 3: HTTP 503: busy"]


def test_poisson_schedule_is_seeded():
    reqs = build(WorkloadSpec("fixed", 2000, 1, 1), _FakeBuilder())
    times = schedule(reqs, 4.0, seed=1)
    assert times == schedule(reqs, 4.0, seed=1) and times != schedule(reqs, 4.0, seed=2)
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.1)
    assert schedule(reqs, math.inf, 0) == [0.0] * 2000


class _FakeBuilder:
    def prompt(self, keys, lengths):
        return [0] * sum(lengths)


def test_the_unbounded_cache_bound_follows_the_run_s_own_timing():
    def rec(i, sent, ttft, e2e, prompt, answer=None):
        return RequestRecord(i, len(prompt), 4, sent_s=sent, ttft_s=ttft, e2e_s=e2e, prompt_ids=prompt,
                             answer_ids=answer)

    doc = list(range(100, 140))  # 10 blocks of 4
    records = [
        rec(0, 0.0, 1.0, 2.0, doc + [1, 2]),
        rec(1, 0.5, 0.2, 0.3, doc + [3, 4]),  # sent while request 0 is computed: waits for it, the document
        rec(2, 1.5, 0.2, 0.3, doc + [5, 6]),  # the whole document
        rec(3, 1.6, 0.1, 0.2, doc[:8]),  # fully cached, but its last token must be computed
        rec(4, 3.0, 0.1, 0.5, doc + [1, 2, 7, 8, 9, 10, 11, 12], [7, 8, 9]),  # request 0's answer ended at 2.0,
    ]                                                                          # unknown: the prompt hits to 40
    records.append(rec(5, 4.0, 0.1, 0.1, doc + [1, 2, 7, 8, 9, 10, 11, 12, 13]))  # request 4's answer: 48
    assert infinite_cache_hits(records, 4) == [0, 40, 40, 4, 40, 48]
    # the answer's last token is never fed back, so no cache has its KV: a block it would complete
    short = [rec(0, 0.0, 0.1, 0.2, [1, 2, 3, 4, 5, 6], [7, 8]), rec(1, 1.0, 0.1, 0.2, [1, 2, 3, 4, 5, 6, 7, 8, 10])]
    assert infinite_cache_hits(short, 4) == [0, 4]
    records[2].error = "boom"
    assert infinite_cache_hits(records, 4)[2] == 0
    records[0].error = "boom"  # a failed prompt stored nothing
    assert infinite_cache_hits(records, 4)[:2] == [0, 0]
    records[0].prompt_ids = None  # a text prompt: no bound
    assert infinite_cache_hits(records, 4) is None


def test_cache_summary_reports_the_hit_ratio_beside_the_bound():
    records = [_record(i, 0.1, [0.01], 2) for i in range(2)]
    for i, r in enumerate(records):
        r.prompt_ids, r.sent_s, r.cached_tokens = [7] * 8 + [i], float(i), 4 * i
        r.usage_prompt_tokens = 9
    c = summarize(records, 2.0, block_tokens=4)["cache"]
    assert (c["prompt_tokens"], c["cached_tokens"], c["computed_tokens"]) == (18, 4, 14)
    assert c["bound_tokens"] == 8 and c["of_bound"] == 0.5 and c["hit_ratio"] == 4 / 18


def test_speculation_summary_from_what_the_server_reports():
    records = [_record(i, 0.1, [0.01], 2) for i in range(3)]
    assert summarize(records, 2.0)["speculation"] is None  # a server that does not speculate says nothing
    for r, (kept, rejected) in zip(records, [(6, 2), (0, 4), (10, 0)]):
        r.drafts_accepted, r.drafts_rejected, r.output_tokens = kept, rejected, 20
    s = summarize(records, 2.0)["speculation"]
    assert (s["accepted"], s["rejected"], s["acceptance"]) == (16, 6, 16 / 22)
    assert s["accepted_per_output_token"] == 16 / 60
    from pdflow.bench.serve_report import _speculation_lines

    assert "accepted 72.7% of draft tokens (16 kept, 6 rejected)" in _speculation_lines(s)[0]


# --- prompts -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def test_trace_prompts_share_exactly_the_shared_blocks(tokenizer, tmp_path):
    rows = [{"timestamp": 0, "input_length": 1300, "output_length": 100, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 3]},
            {"timestamp": 1500, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 2, 4]},
            {"timestamp": 2000, "input_length": 40, "output_length": 7, "hash_ids": [9]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = WorkloadSpec("trace", path=str(trace), token_scale=0.1, time_scale=2.0)
    a, b, c, d = build(spec, PromptBuilder(tokenizer, seed=5))
    block = 51  # round(512 * 0.1)
    assert [r.prompt_len for r in (a, b, c, d)] == [130, 110, 160, 4]
    assert [len(r.prompt) for r in (a, b, c, d)] == [130, 110, 160, 4]
    assert [r.output_len for r in (a, b, c, d)] == [10, 30, 1, 1]
    assert [r.arrival_s for r in (a, b, c, d)] == [0.0, 0.25, 0.75, 1.0]
    assert shared_prefix_blocks(a, b) == 2
    assert a.prompt[:2 * block] == b.prompt[:2 * block] and a.prompt[2 * block] != b.prompt[2 * block]
    assert c.prompt[:130] == a.prompt  # hash 2's partial block in a is a prefix of its full block in c
    again = build(spec, PromptBuilder(tokenizer, seed=5))
    assert [r.prompt for r in again] == [r.prompt for r in (a, b, c, d)]  # deterministic
    assert build(spec, PromptBuilder(tokenizer, seed=6))[0].prompt != a.prompt
    builder = PromptBuilder(tokenizer, seed=5)
    text = builder.text(a.prompt)
    assert len(text.split()) >= 100 and all(w.isalpha() for w in text.split()[:-1])  # real words
    assert abs(builder.retokenize_error(c.prompt)) <= 2


def test_fixed_and_random_prompts_have_the_asked_lengths_and_do_not_share(tokenizer):
    builder = PromptBuilder(tokenizer)
    fixed = build(WorkloadSpec("fixed", 5, input_len=33, output_len=4), builder)
    assert all(len(r.prompt) == r.prompt_len == 33 and r.output_len == 4 for r in fixed)
    assert len({tuple(r.prompt[:4]) for r in fixed}) == 5
    rand = build(WorkloadSpec("random", 50, input_len_range=(5, 20), output_len_range=(2, 3), seed=3), builder)
    assert {len(r.prompt) for r in rand} <= set(range(5, 21)) and len({len(r.prompt) for r in rand}) > 5
    assert {r.output_len for r in rand} == {2, 3}


# --- the client on a canned stream, and plots ------------------------------------------------------


def test_sampled_conversations_keep_every_turn_of_the_picked_ones(tmp_path):
    rows = [{"timestamp": t, "input_length": 10, "output_length": 2, "hash_ids": ids} for t, ids in
            [(0, [0, 1, 2]), (5, [0, 5]), (7, [0, 1, 2, 3]), (9, [0, 6, 7]), (12, [0, 6, 7, 8]), (20, [0, 1, 2, 3, 4])]]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = {(0, 1): [0, 7, 20], (0, 5): [5], (0, 6): [9, 12]}
    for seed in range(6):
        picked = trace_rows(WorkloadSpec("trace", path=str(path), sample_conversations=2, seed=seed))
        times = [r["timestamp"] for r in picked]
        assert times == sorted(times)
        kept = {tuple(r["hash_ids"][:2]) for r in picked}
        assert len(kept) == 2 and times == sorted(t for key in kept for t in conversations[key])
    assert reusable_fraction(rows) == (0 + 1 + 3 + 1 + 3 + 4) / 21


def test_rag_and_multiturn_workloads_share_what_they_should(tokenizer):
    builder = PromptBuilder(tokenizer, 3)
    rag = build(WorkloadSpec("rag", documents=3, doc_len=50, questions=2, question_len=5, output_len=4), builder)
    assert len(rag) == 6 and all(r.prompt_len == 55 for r in rag)
    by_doc: dict = {}
    for r in rag:
        by_doc.setdefault(tuple(r.prompt[:50]), []).append(r.prompt[50:])
    assert len(by_doc) == 3 and all(len(qs) == 2 and qs[0] != qs[1] for qs in by_doc.values())
    spec = WorkloadSpec("multiturn", sessions=2, turns=3, input_len=40, turn_len=6, output_len=4)
    sessions = build_sessions(spec, builder)
    assert [s.turns for s in sessions] == [3, 3] and sessions[0].first != sessions[1].first
    assert all(len(s.first) == 40 and [len(m) for m in s.messages] == [6, 6] for s in sessions)
    assert [r.prompt for r in build(spec, builder)] == [s.first for s in sessions]
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec("multiturn", turns=0)


def test_chat_stream_counts_text_chunks_and_usage():
    events = [
        {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": 4}}},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    async def go(content: bytes, status: int = 200) -> RequestRecord:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))
        record = RequestRecord(0, 9, 3)
        async with httpx.AsyncClient(transport=transport) as client:
            await send(client, "http://x/v1/chat/completions", {"messages": []}, record, origin=0.0, keep_text=True)
        return record

    r = asyncio.run(go(body))
    assert r.ok and r.chunks == 2 and len(r.gaps_s) == 1 and r.request_id == "c1"
    assert r.text == "Hi there" and r.cached_tokens == 4
    assert (r.usage_completion_tokens, r.output_tokens, r.finish_reason) == (3, 3, "length")
    assert 0 <= r.ttft_s <= r.e2e_s
    bad = asyncio.run(go(b'data: {"error": {"message": "boom"}}\n\n'))
    assert "boom" in bad.error
    assert asyncio.run(go(b'{"error": "nope"}', status=400)).error.startswith("HTTP 400")


@pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")
def test_plots_for_a_sweep(tmp_path):
    def fake_run(rate, stall):
        records = [_record(i, 0.1 * rate, [0.01, stall], 3) for i in range(5)]
        return {"label": f"rate={rate}", "request_rate": rate, "records": [r.to_json() for r in records],
                "metrics": summarize(records, 5 / rate, 500, 50)}

    paths = plots.write_all([fake_run(1, 0.02), fake_run(2, 0.2)], tmp_path)
    assert {p.name for p in paths} >= {"latency_cdf.png", "goodput_vs_rate.png"}
    assert all(p.stat().st_size > 1000 for p in paths)
    compared = plots.plot_compare({"pd": [fake_run(1, 0.02), fake_run(2, 0.05)],
                                   "colocated": [fake_run(1, 0.3), fake_run(2, 0.9)]}, tmp_path / "compare.png")
    assert compared.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and compared.stat().st_size > 1000


# --- against a real server --------------------------------------------------------------------------


def _bench(server, tmp_path, *argv) -> dict:
    out = tmp_path / "result.json"
    args = parse_args(["--base-url", server.url, "--no-progress", "--result-json", str(out), *argv])
    assert main(args) == 0
    assert reproduce(args).startswith("pdflow bench serve --base-url")
    return json.loads(out.read_text())


def _check_consistent(run: dict) -> None:
    m = run["metrics"]
    assert set(SCALARS) <= m.keys()
    for key in DISTRIBUTIONS:
        assert {"count", "mean", "min", "p50", "p90", "p99", "max"} <= m[key].keys()
        assert m[key]["min"] <= m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"] <= m[key]["max"]
    assert m["failed"] == 0 and m["errors"] == [] and m["completed"] == m["requests"]
    assert m["usage_missing"] == 0 and m["output_len_differs"] == 0
    for r in run["records"]:
        assert r["error"] is None
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["sent_s"] >= r["scheduled_s"]
        assert r["output_tokens"] == r["output_len"] == r["usage_completion_tokens"]
        assert r["usage_prompt_tokens"] == r["prompt_len"]  # token-id prompts: counts are exact
        assert 1 <= r["chunks"] <= r["usage_completion_tokens"] and len(r["gaps_s"]) == r["chunks"] - 1
        assert r["ttft_s"] + sum(r["gaps_s"]) <= r["e2e_s"]
    assert m["output_tokens"] == sum(r["output_len"] for r in run["records"])


@e2e
def test_smoke_fixed_workload(server, tmp_path):
    result = _bench(server, tmp_path, "--input-len", "32", "--output-len", "8", "--num-prompts", "4",
                    "--max-concurrency", "2", "--timelines", "--plot-dir", str(tmp_path / "plots"))
    assert result["model"] == "smollm2" and result["workload"]["retokenize_error"]["max_abs_tokens"] <= 2
    (run,) = result["runs"]
    _check_consistent(run)
    assert run["metrics"]["goodput_fraction"] == 1.0  # no SLO set
    assert all(r["timeline"] and "prefill.start" in r["timeline"] for r in run["records"])
    if plots.available():
        assert {Path(p).name for p in result["plots"]} == {"latency_cdf.png", "tbt_over_time.png"}


@e2e
def test_trace_replay_keeps_prefixes(server, tmp_path):
    result = _bench(server, tmp_path, "--dataset", "trace", "--dataset-path",
                    str(TRACES / "conversation_trace_excerpt.jsonl"), "--token-scale", "0.01", "--time-scale", "1000",
                    "--limit", "3", "--save-prompts")
    (run,) = result["runs"]
    _check_consistent(run)
    block = result["workload"]["block_tokens"]
    assert block == 5
    rows = [json.loads(line) for line in (TRACES / "conversation_trace_excerpt.jsonl").open().readlines()[:3]]
    a, b = run["records"][0], run["records"][1]
    shared = next(i for i, (x, y) in enumerate(zip(rows[0]["hash_ids"], rows[1]["hash_ids"])) if x != y)
    assert shared >= 1  # the trace's first two requests share their first block
    assert a["prompt"][:shared * block] == b["prompt"][:shared * block]
    assert a["prompt"][shared * block:(shared + 1) * block] != b["prompt"][shared * block:(shared + 1) * block]
    assert [r["output_len"] for r in run["records"]] == [round(row["output_length"] * 0.01) for row in rows]


@e2e
def test_multiturn_sessions_send_their_answers_back_and_hit_the_cache(server, tmp_path):
    result = _bench(server, tmp_path, "--dataset", "multiturn", "--sessions", "2", "--turns", "3", "--input-len",
                    "140", "--turn-len", "12", "--output-len", "6", "--think-time", "0", "--seed", "7")
    (run,) = result["runs"]
    records = run["records"]
    assert [(r["session"], r["turn"]) for r in sorted(records, key=lambda r: (r["session"], r["turn"]))] == [
        (s, t) for s in range(2) for t in range(3)]
    for s in range(2):
        turns = sorted((r for r in records if r["session"] == s), key=lambda r: r["turn"])
        assert all(r["error"] is None for r in turns)
        # every turn re-sends the last prompt, the answer (6 tokens, give or take a re-tokenized
        # boundary) and 12 new tokens; from the second turn on the store holds the history
        for before, after in zip(turns, turns[1:]):
            assert 12 + 4 <= after["usage_prompt_tokens"] - before["usage_prompt_tokens"] <= 12 + 8
            assert after["cached_tokens"] >= before["usage_prompt_tokens"] // 64 * 64 > 0
    cache = run["metrics"]["cache"]
    assert cache["reported"] == 6 and cache["cached_tokens"] > 0 and cache["bound_tokens"] >= 64
    assert cache["computed_tokens"] == cache["prompt_tokens"] - cache["cached_tokens"]


@e2e
def test_rag_questions_hit_their_document(server, tmp_path):
    result = _bench(server, tmp_path, "--dataset", "rag", "--documents", "2", "--doc-len", "200", "--questions",
                    "2", "--question-len", "8", "--output-len", "4", "--max-concurrency", "1", "--seed", "9")
    (run,) = result["runs"]
    _check_consistent(run)
    cache = run["metrics"]["cache"]
    assert cache["bound_tokens"] == 2 * 192  # each document's second question: its 3 full blocks
    assert cache["cached_tokens"] == cache["bound_tokens"] and cache["of_bound"] == 1.0
