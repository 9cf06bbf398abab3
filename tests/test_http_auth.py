"""The HTTP API key, on the app itself (no stages behind it): OpenAI-style bearer tokens, a 401
in OpenAI's error format otherwise, /health and the OpenAPI document left open."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
from fastapi.testclient import TestClient

from pdflow import Pipeline
from pdflow.security.keys import SecretError, load_api_key
from pdflow.serving.http_api import build_app
from pdflow.serving.metrics import ServingMetrics
from pdflow.testing.server import free_port_base


def _ingress(api_key: str | None, pipeline: Pipeline | None = None, **fields) -> types.SimpleNamespace:
    ingress = types.SimpleNamespace(**{
        "api_key": api_key, "pipeline": pipeline or Pipeline.default(), "served_name": "smollm2", "max_context": 8192,
        "vocab_size": 49152, "down": set(), "stage_status": {}, "accepting": True, "requests": {}, "timelines": {},
        **fields})
    ingress.metrics = ServingMetrics(ingress)
    return ingress


def _app(api_key: str | None, pipeline: Pipeline | None = None) -> TestClient:
    return TestClient(build_app(_ingress(api_key, pipeline)))


@contextlib.contextmanager
def _serving(ingress):
    """The app of ``ingress`` served over HTTP on a free port of this machine (uvicorn, in a thread)."""
    import uvicorn

    # log_config=None, as pdflow's own server: uvicorn's default config would leave handlers bound to
    # this test's captured stderr on its loggers, for later tests to write into once it is closed
    server = uvicorn.Server(uvicorn.Config(build_app(ingress), host="127.0.0.1", port=free_port_base(1),
                                           log_level="error", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_with_a_key_every_api_route_wants_it_and_health_stays_open():
    client = _app("s3cret-key")
    refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "type": "invalid_request_error",
                                       "param": "authorization", "code": "invalid_api_key"}
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "s3cret-key"}).status_code == 401  # not a bearer
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401  # before the body is read
    assert client.get("/debug/timeline/x").status_code == 401
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    assert client.get("/health").status_code in (200, 503)  # open: for load balancers
    assert client.get("/openapi.json").status_code == 200
    assert "s3cret-key" not in refused.text
    metrics = client.get("/metrics", headers={"Authorization": "Bearer s3cret-key"})
    assert metrics.status_code == 200
    assert 'pdflow_http_refusals_total{status="401"} 8.0' in metrics.text  # the refusals above, counted


def test_metrics_open_serves_metrics_without_the_key_and_nothing_else(tmp_path):
    from pdflow.cli import _load, _parser

    topology = tmp_path / "topology.toml"
    topology.write_text("[server]\nmetrics_open = true\n")
    for pipeline in (_load(_parser().parse_args(["validate", str(topology)])),
                     _load(_parser().parse_args(["validate", "--metrics-open"]))):  # the key, or the flag
        assert pipeline.server.metrics_open
        client = _app("s3cret-key", pipeline)
        assert client.get("/metrics").status_code == 200
        assert "vllm:num_requests_running" in client.get("/metrics").text
        assert client.get("/v1/models").status_code == 401
        assert client.get("/debug/timeline/x").status_code == 401
    assert _app("s3cret-key").get("/metrics").status_code == 401  # closed by default


def test_the_client_commands_send_the_key_of_their_flag_or_of_the_environment(tmp_path, monkeypatch, capsys):
    from pdflow.cli import main

    timeline = {"prefill.start": [0.0], "prefill.layer_done": [0.1, 0.2], "prefill.end": [0.2],
                "decode.layer_in": [0.15, 0.25], "decode.steps": [0.3], "decode.end": [0.3]}
    with _serving(_ingress("s3cret-key", timelines={"cmpl-1": timeline})) as url:
        trace = ["trace", "cmpl-1", "--url", url, "-o", str(tmp_path / "trace.json")]
        monkeypatch.delenv("PDFLOW_API_KEY", raising=False)
        assert main(trace) == 1
        assert "401" in capsys.readouterr().err and not (tmp_path / "trace.json").exists()
        assert main([*trace, "--api-key", "s3cret-key"]) == 0
        assert "KV tail 50.00 ms" in capsys.readouterr().out and (tmp_path / "trace.json").exists()
        monkeypatch.setenv("PDFLOW_API_KEY", "s3cret-key")
        assert main(trace) == 0 and main(["top", "--once", "--interval", "0.1", "--url", url]) == 0
        monkeypatch.setenv("PDFLOW_API_KEY", "wrong")
        assert main(["top", "--once", "--interval", "0.1", "--url", url]) == 1
        assert "401" in capsys.readouterr().err


def test_without_a_key_the_api_is_open():
    assert _app(None).get("/v1/models").status_code == 200


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    pipeline = Pipeline.default()
    assert load_api_key(pipeline.security) is None
    assert load_api_key(pipeline.security, "from-flag") == "from-flag"
    monkeypatch.setenv("MY_KEY", "from-env\n")
    assert load_api_key(pipeline.with_security(api_key_env="MY_KEY").security) == "from-env"
    key_file = tmp_path / "api.key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    assert load_api_key(pipeline.with_security(api_key_file=key_file).security) == "from-file"
    key_file.chmod(0o644)
    with pytest.raises(SecretError, match="readable by others"):
        load_api_key(pipeline.with_security(api_key_file=key_file).security)
    with pytest.raises(SecretError, match="NOT_SET"):
        load_api_key(pipeline.with_security(api_key_env="NOT_SET").security)
