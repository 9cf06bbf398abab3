"""Each example in examples/ runs, as a user would run it, and does what it says."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.server import free_port_base

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(script: str, *args: str, timeout: float = 400) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_in_process_pipeline_answers_through_the_openai_client():
    assert "Paris" in _run("in_process.py", "--port", str(free_port_base()))


def test_custom_router_keeps_a_shared_prefix_on_one_replica():
    out = _run("custom_router.py", "--port", str(free_port_base()))
    picked = ast.literal_eval(out.split("replicas picked:")[1].strip())  # {('decode', 0): 3, ...}
    decode = {replica: n for (stage, replica), n in picked.items() if stage == "decode"}
    assert sum(decode.values()) == 3 and len(decode) == 1  # chats share the template's first 16 tokens


def test_custom_stage_redacts_between_egress_and_ingress(tmp_path):
    port = free_port_base()
    log = open(tmp_path / "example.log", "wb")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "custom_stage.py"), "--port", str(port),
                             "--words", "Paris"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "example.log").read_text()[-3000:]
            try:
                if local_http().get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        client = openai_client(f"http://127.0.0.1:{port}", timeout=120)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=20)
        text = reply.choices[0].message.content
        assert "[redacted]" in text and "Paris" not in text, text
        health = local_http().get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        assert "redact-0" in health["stages"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log.close()
