"""The HTTP API key, on the app itself (no stages behind it): OpenAI-style bearer tokens, a 401
in OpenAI's error format otherwise, /health and the OpenAPI document left open."""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

from pdflow import Pipeline
from pdflow.security.keys import SecretError, load_api_key
from pdflow.serving.http_api import build_app
from pdflow.serving.metrics import ServingMetrics


def _app(api_key: str | None) -> TestClient:
    ingress = types.SimpleNamespace(
        api_key=api_key, pipeline=Pipeline.default(), served_name="smollm2", max_context=8192, vocab_size=49152, down=set(),
        stage_status={}, accepting=True, requests={}, timelines={})
    ingress.metrics = ServingMetrics(ingress)
    return TestClient(build_app(ingress))


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
