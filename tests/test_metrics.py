"""Prometheus metrics (GET /metrics) and `pdflow top`: the arithmetic on its own, then a real
pipeline's endpoint counting what the official client sent it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import httpx
import openai
import pytest

from pdflow import Pipeline
from pdflow.messages import Route
from pdflow.serving.metrics import ServingMetrics
from pdflow.stages.ingress import PendingRequest
from pdflow.top import Scrape, quantile, render
from tests.conftest import shared_server


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
    status = {
        "prefill-0": {"state": "ready", "in_flight": 3, "restarts": 1, "stats": {"kv_sent_bytes@kv-shuttle": 4096}},
        "kv-shuttle-0": {"state": "ready", "in_flight": 2, "restarts": 0,
                         "stats": {"lookups": 4, "hits": 3, "bytes_used": 100, "bytes_total": 1000,
                                   "kv_sent_bytes@decode": 8192, "leases": 2}},
        "decode-0": {"state": "restarting", "in_flight": 0, "restarts": 2,
                     "stats": {"batch_size": 5, "decode_steps": 10, "decode_step_rows": 35}},
    }
    s = _scrape(_ingress(status).metrics)
    assert s.value("pdflow_replicas", stage="decode", state="restarting") == 1
    assert s.value("pdflow_replicas", stage="ingress", state="unreported") == 1  # no report yet
    assert s.value("pdflow_replicas_configured", stage="prefill") == 1
    assert s.value("pdflow_stage_in_flight", stage="prefill", replica="0") == 3
    assert s.value("pdflow_stage_restarts_total", stage="decode") == 2
    assert s.value("pdflow_kv_sent_bytes_total", stage="prefill", peer="kv-shuttle") == 4096
    assert s.value("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="decode") == 8192
    assert s.value("pdflow_kv_store_hit_ratio", stage="kv-shuttle") == 0.75
    assert s.value("pdflow_kv_store_bytes", tier="memory", kind="used") == 100
    assert s.value("pdflow_decode_batch_size", stage="decode") == 5
    assert s.value("pdflow_decode_step_rows_total") / s.value("pdflow_decode_steps_total") == 3.5
    assert s.value("pdflow_stage_counter", name="leases") == 2
    text = _frame(None, s)
    assert "0/1 ready (1 restarting)" in text and "75%" in text and "-> decode 8.2 KB" in text


def _frame(before: Scrape | None, now: Scrape) -> str:
    from rich.console import Console

    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(before, now, "http://test"))
    return console.export_text()


# --- a real pipeline -----------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_pipeline_counts_what_it_served_and_top_shows_it(request):
    server = shared_server(request, "disaggregated")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def scrape() -> Scrape:
        response = httpx.get(f"{server.url}/metrics", timeout=10)
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
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 9}, timeout=30).status_code == 400

    def grew(name: str, **labels) -> float:
        return now.value(name, **labels) - before.value(name, **labels)

    def reported() -> bool:  # the stages' own counters come with their next heartbeats
        return grew("pdflow_kv_sent_bytes_total", stage="prefill", peer="kv-shuttle") > 0 and \
            grew("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="decode") > 0 and \
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
    assert grew("pdflow_kv_sent_bytes_total", stage="kv-shuttle", peer="decode") > 0
    assert grew("pdflow_decode_steps_total", stage="decode") > 0
    assert grew("pdflow_kv_store_lookups_total", stage="kv-shuttle") >= 3
    for stage in ("ingress", "prefill", "kv-shuttle", "decode"):
        assert now.value("pdflow_replicas", stage=stage, state="ready") == 1

    shown = subprocess.run([sys.executable, "-m", "pdflow.cli", "top", "--once", "--interval", "0.2",
                            "--url", server.url], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "160"})
    assert shown.returncode == 0, shown.stderr
    for expected in ("kv-shuttle-0", "1/1 ready", "-> kv-shuttle", "TTFT"):
        assert expected in shown.stdout, shown.stdout
