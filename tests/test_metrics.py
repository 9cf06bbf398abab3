"""Prometheus metrics (GET /metrics) and `pdflow top`: the arithmetic on its own, then a real
pipeline's endpoint counting what the official client sent it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

from pdflow import Pipeline
from pdflow.messages import Route
from pdflow.serving.metrics import ServingMetrics
from pdflow.stages.ingress import PendingRequest
from pdflow.testing.local_http import local_http, openai_client
from pdflow.top import Scrape, quantile, render
from tests.conftest import shared_server
from tests.grafana import ONLY_WITH_SPECULATION, dashboard_metrics, scraped_series


def _ingress(stage_status: dict | None = None):
    ingress = types.SimpleNamespace(pipeline=Pipeline.default(), requests={}, stage_status=stage_status or {})
    ingress.metrics = ServingMetrics(ingress)
    return ingress


def _scrape(metrics: ServingMetrics, at: float = 0.0) -> Scrape:
    return Scrape.parse(metrics.render().decode(), at)


def test_first_token_is_ttft_and_each_later_gap_is_shared_by_the_tokens_it_brought():
    metrics = _ingress().metrics
    pending = PendingRequest("r", Route(), prompt_len=100, received=10.0, cached_tokens=64)
    metrics.tokens_arrived(pending, 1, now=10.5)  # first token after 0.5 s
    metrics.tokens_arrived(pending, 2, now=10.52)  # one token after 20 ms
    metrics.tokens_arrived(pending, 2, now=10.6)  # no new token: nothing observed
    metrics.tokens_arrived(pending, 5, now=10.67)  # three tokens 150 ms after the last: 50 ms each
    metrics.finished(pending)
    s = _scrape(metrics)
    assert s.value("pdflow_time_to_first_token_seconds_count") == 1
    assert s.value("pdflow_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert s.value("pdflow_time_between_tokens_seconds_count") == 4
    assert s.value("pdflow_time_between_tokens_seconds_sum") == pytest.approx(0.02 + 3 * 0.05)
    assert s.value("pdflow_e2e_request_latency_seconds_sum") == pytest.approx(0.67)
    assert s.value("pdflow_generation_tokens_total") == 5
    assert s.value("pdflow_prompt_tokens_total") == 100 and s.value("pdflow_cached_prompt_tokens_total") == 64
    assert s.value("pdflow_requests_total", outcome="finished") == 1
    metrics.ended("client disconnected")
    metrics.ended("stage down")
    metrics.refusal(429)
    s = _scrape(metrics)
    assert s.value("pdflow_requests_total", outcome="cancelled") == 1
    assert s.value("pdflow_requests_total", outcome="failed") == 1
    assert s.value("pdflow_http_refusals_total", status="429") == 1


def test_quantiles_come_from_the_buckets_of_the_window_between_two_scrapes():
    metrics = _ingress().metrics
    for seconds in (0.03, 0.03, 0.07, 0.07):  # all between the 0.025 and 0.05, 0.05 and 0.1 buckets
        metrics.ttft.observe(seconds)
    before = _scrape(metrics, at=0.0)
    for _ in range(10):
        metrics.ttft.observe(4.0)  # in (2.5, 5]
    now = _scrape(metrics, at=1.0)
    name = "pdflow_time_to_first_token_seconds"
    assert 2.5 < quantile(0.5, before, now, name) <= 5.0  # the window saw only the slow ones
    assert quantile(0.5, None, now, name) > 2.5 and quantile(0.1, None, now, name) < 0.1  # since the start
    assert quantile(0.25, None, now, name) == pytest.approx(0.05 + 0.05 * (3.5 - 2) / 2)  # interpolated
    assert quantile(0.5, now, now, name) is None  # nothing in between


def test_stage_reports_become_replica_counts_queue_depths_link_bytes_and_store_figures():
    store = {"lookups": 4, "hits": 3, "queried_tokens": 640, "hit_tokens": 320, "hit_blocks": 20, "blocks_used": 25,
             "blocks_total": 100, "bytes_used": 100, "bytes_total": 1000, "disk_load_bytes": 50, "spill_bytes": 70}
    status = {
        "prefill-0": {"state": "ready", "in_flight": 3, "restarts": 1,
                      "stats": {"kv_sent_bytes@kv-shuttle": 4096, "requests_running": 1, "requests_waiting": 2}},
        "kv-shuttle-0": {"state": "ready", "in_flight": 2, "restarts": 0,
                         "stats": {**store, "kv_sent_bytes@decode": 8192, "kv_sent_bytes@kv-shuttle": 16, "leases": 2}},
        "decode-0": {"state": "restarting", "in_flight": 0, "restarts": 2,
                     "stats": {"batch_size": 5, "decode_steps": 10, "decode_step_rows": 35, "requests_running": 5,
                               "requests_waiting": 1, "pool_blocks": 40, "pool_free_blocks": 30,
                               "awaiting_pool_blocks": 1, "speculative_drafts": 7, "speculative_proposed": 21,
                               "speculative_accepted": 12}},
    }
    s = _scrape(_ingress(status).metrics)
    assert s.value("pdflow_replicas", stage="decode", state="restarting") == 1
    assert s.value("pdflow_replicas", stage="ingress", state="unreported") == 1  # no report yet
    assert s.value("pdflow_replicas_configured", stage="prefill") == 1
    assert s.value("pdflow_stage_in_flight", stage="prefill", replica="0") == 3
    assert s.value("pdflow_stage_restarts_total", stage="decode") == 2
    assert s.value("pdflow_kv_sent_bytes_total", stage="prefill", peer="kv-shuttle", transport="tcp") == 4096
    assert s.value("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="decode", transport="tcp") == 8192
    assert s.value("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="kv-shuttle", transport="peer") == 16
    assert s.value("pdflow_kv_store_lookups_total", stage="kv-shuttle") == 4
    assert s.value("pdflow_kv_store_hits_total", stage="kv-shuttle") == 3
    assert s.value("pdflow_kv_store_hit_bytes_total", tier="memory") == 20 * 10  # blocks x bytes a block
    assert s.value("pdflow_kv_store_hit_bytes_total", tier="disk") == 50
    assert s.value("pdflow_kv_store_spilled_bytes_total") == 70
    assert s.value("pdflow_kv_store_bytes", tier="memory", kind="used") == 100
    assert s.value("pdflow_decode_batch_size", stage="decode") == 5
    assert s.value("pdflow_decode_step_rows_total") / s.value("pdflow_decode_steps_total") == 3.5
    assert s.value("pdflow_decode_pool_blocks", kind="free") == 30
    assert s.value("pdflow_stage_counter", name="leases") == 2
    assert s.value("pdflow_stage_counter", name="speculative_drafts") == 0  # a counter of its own now
    model = {"model_name": "smollm2"}
    assert s.value("vllm:num_requests_running", **model) == 6 and s.value("vllm:num_requests_waiting", **model) == 3
    assert s.value("vllm:kv_cache_usage_perc", engine="decode-0", **model) == 0.25  # decode's pool, not the store
    assert s.value("vllm:kv_cache_usage_perc", engine="kv-shuttle-0") == 0
    assert s.value("vllm:prefix_cache_queries_total", engine="kv-shuttle-0", **model) == 640
    assert s.value("vllm:prefix_cache_hits_total", engine="kv-shuttle-0", **model) == 320
    assert s.value("vllm:spec_decode_num_draft_tokens_total", engine="decode-0", **model) == 21
    assert s.value("vllm:spec_decode_num_accepted_tokens_total", engine="decode-0", **model) == 12
    text = _frame(None, s)
    assert "0/1 ready (1 restarting)" in text and "75%" in text and "-> decode 8.2 KB" in text


def test_a_finished_request_s_timeline_gives_its_phases_and_its_kv_path():
    metrics = _ingress().metrics
    pending = PendingRequest("r", Route(), prompt_len=10, received=0.0)
    metrics.tokens_arrived(pending, 1, now=1.0)
    metrics.tokens_arrived(pending, 3, now=1.5)
    timeline = {"prefill.queued": [0.1], "prefill.dequeued": [0.3], "prefill.start": [0.3], "prefill.end": [0.8],
                "prefill.layer_done": [0.5, 0.7], "prefill.send_start": [0.5], "decode.layer_in": [0.6, 0.75],
                "decode.joined": [0.76], "decode.end": [1.5]}
    metrics.finished(pending, timeline, "length")
    metrics.finished(pending, timeline, "stop", one_clock=False)  # prefill and decode on two machines
    metrics.ended("stage down")
    s = _scrape(metrics)
    model = {"model_name": "smollm2"}
    for name, seconds in (("queue", 0.2), ("prefill", 0.5), ("decode", 0.74), ("inference", 1.24)):
        assert s.value(f"vllm:request_{name}_time_seconds_count", **model) == 2
        assert s.value(f"vllm:request_{name}_time_seconds_sum", **model) == pytest.approx(2 * seconds)
    assert s.value("pdflow_kv_transfer_seconds_count", **model) == 1  # only where one clock read both ends
    assert s.value("pdflow_kv_transfer_seconds_sum") == pytest.approx(0.25)
    assert s.value("pdflow_kv_tail_seconds_sum") == pytest.approx(0.05)
    assert s.value("vllm:request_success_total", finished_reason="length", **model) == 1
    assert s.value("vllm:request_success_total", finished_reason="stop") == 1
    assert s.value("vllm:request_success_total", finished_reason="abort") == 1
    assert s.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert s.value("vllm:inter_token_latency_seconds_count") == 2  # two tokens in one 0.5 s gap
    assert s.value("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert s.value("vllm:request_generation_tokens_sum") == 6 and s.value("vllm:prompt_tokens_total") == 20
    assert s.value("vllm:request_time_per_output_token_seconds_count") == 2  # once a request, not a token
    assert s.value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(2 * 0.5 / 2)
    assert s.value("vllm:generation_tokens_total") == 3


def _frame(before: Scrape | None, now: Scrape) -> str:
    from rich.console import Console

    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(before, now, "http://test"))
    return console.export_text()


# --- a real pipeline -----------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_pipeline_counts_what_it_served_and_top_shows_it(request):
    server = shared_server(request, "disaggregated")
    client = openai_client(server.url, timeout=120)

    def scrape() -> Scrape:
        response = local_http().get(f"{server.url}/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return Scrape.parse(response.text, time.monotonic())

    before = scrape()
    tokens = 0
    for i in range(2):
        reply = client.completions.create(model="smollm2", prompt=f"Metrics test {i}: one, two,", max_tokens=6,
                                          temperature=0)
        tokens += reply.usage.completion_tokens
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    tokens += [chunk for chunk in stream][-1].usage.completion_tokens
    refused = local_http().post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 9}, timeout=30)
    assert refused.status_code == 400

    def grew(name: str, **labels) -> float:
        return now.value(name, **labels) - before.value(name, **labels)

    def into_decode() -> float:  # from the store, or from prefill itself (the shared server runs kv.direct)
        return grew("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="decode") + \
            grew("pdflow_kv_sent_bytes_total", stage="prefill", peer="decode")

    def reported() -> bool:  # the stages' own counters come with their next heartbeats
        return grew("pdflow_kv_sent_bytes_total", stage="prefill", peer="kv-shuttle") > 0 and into_decode() > 0 and \
            grew("pdflow_decode_steps_total") > 0 and grew("pdflow_kv_store_lookups_total", stage="kv-shuttle") >= 3

    deadline = time.monotonic() + 15
    now = scrape()
    while not reported() and time.monotonic() < deadline:
        time.sleep(0.3)
        now = scrape()
    assert grew("pdflow_requests_total", outcome="finished") == 3
    assert grew("pdflow_time_to_first_token_seconds_count") == 3
    assert grew("pdflow_e2e_request_latency_seconds_count") == 3
    assert grew("pdflow_generation_tokens_total") == tokens
    assert grew("pdflow_time_between_tokens_seconds_count") == tokens - 3
    assert grew("pdflow_http_refusals_total", status="400") == 1
    assert grew("pdflow_kv_sent_bytes_total", stage="prefill", peer="kv-shuttle") > 0
    assert into_decode() > 0
    assert now.series("pdflow_kv_network_bytes_total") and grew("pdflow_kv_network_bytes_total") == 0  # one host
    assert grew("pdflow_decode_steps_total", stage="decode") > 0
    assert grew("pdflow_kv_store_lookups_total", stage="kv-shuttle") >= 3
    for stage in ("ingress", "prefill", "kv-shuttle", "decode"):
        assert now.value("pdflow_replicas", stage=stage, state="ready") == 1
    # the same requests in vLLM's names, and the disaggregation's own histograms (one machine: one clock)
    model = {"model_name": "smollm2"}
    assert grew("vllm:request_success_total", **model) == 3
    assert grew("vllm:request_success_total", finished_reason="abort", **model) == 0
    assert grew("vllm:generation_tokens_total", **model) == tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert grew(f"vllm:{name}_count", **model) == 3, name
    assert grew("pdflow_kv_transfer_seconds_count", **model) == 3 and grew("pdflow_kv_tail_seconds_count") == 3
    assert 0 < grew("pdflow_kv_tail_seconds_sum") <= grew("pdflow_kv_transfer_seconds_sum")
    assert grew("vllm:prefix_cache_queries_total", engine="kv-shuttle-0", **model) > 0
    transports = {dict(k)["transport"] for k in now.series("pdflow_kv_sent_bytes_total")}
    assert transports and transports <= {"tcp", "shm", "ucx", "verbs", "inproc", "peer"}
    usage = {dict(k)["engine"]: v for k, v in now.series("vllm:kv_cache_usage_perc").items()}
    assert set(usage) == {"decode-0"} and 0 <= usage["decode-0"] < 1  # decode's pool, not the store's

    shown = subprocess.run([sys.executable, "-m", "pdflow.cli", "top", "--once", "--interval", "0.2",
                            "--url", server.url], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "160"})
    assert shown.returncode == 0, shown.stderr
    for expected in ("kv-shuttle-0", "1/1 ready", "-> kv-shuttle", "TTFT"):
        assert expected in shown.stdout, shown.stdout


@pytest.mark.e2e
def test_every_series_the_grafana_dashboard_reads_is_in_a_scrape_of_a_serving_pipeline(request):
    server = shared_server(request, "disaggregated")
    client = openai_client(server.url, timeout=120)
    for _ in range(2):  # the second finds the first's prefix in the store
        client.completions.create(model="smollm2", prompt="Dashboards read " * 20, max_tokens=3, temperature=0)
    wanted = dashboard_metrics() - ONLY_WITH_SPECULATION
    deadline = time.monotonic() + 15
    while True:  # the stages' series come with their next heartbeats
        missing = wanted - scraped_series(local_http().get(f"{server.url}/metrics", timeout=10).text)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not missing, f"the dashboard reads series this server does not export: {sorted(missing)}"
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "pdflow_kv_transfer_seconds_bucket",
            "pdflow_kv_sent_bytes_total"} <= wanted  # (the parsing above found the queries' names)
