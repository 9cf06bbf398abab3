"""One log pipeline: structlog's events and the standard library's records (the kernels' loader,
uvicorn, ``warnings``) leave through one renderer, so that ``--log-format json`` gives one JSON
object per line (the end-to-end check: tests/test_e2e_failures.py, a whole run's log)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest
import structlog

from pdflow.log import configure_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def test_json_format_renders_every_logger_s_lines_as_json_with_the_stage_s_context(capsys, restore_logging):
    configure_logging("json", "info", stage="decode", replica=1)
    structlog.get_logger().info("batch.stepped", rows=3)
    logging.getLogger("pdflow.kernels").warning("compiled %s in %.1f s", "qgemm", 4.25)
    logging.getLogger("uvicorn.error").error("Invalid HTTP request received.")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("pdflow.engine.packed_cache").exception("packing failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    logging.getLogger("pdflow.kernels").debug("below the level: not shown")
    lines = capsys.readouterr().err.splitlines()
    events = [json.loads(line) for line in lines]  # every line is JSON
    assert len(events) == 5
    by_event = {e["event"]: e for e in events}
    assert by_event["batch.stepped"]["rows"] == 3
    kernels = by_event["compiled qgemm in 4.2 s"]
    assert kernels["logger"] == "pdflow.kernels" and kernels["level"] == "warning"
    assert by_event["Invalid HTTP request received."]["logger"] == "uvicorn.error"
    assert "ValueError: boom" in by_event["packing failed"]["exception"]
    assert any(e.get("logger") == "py.warnings" and "an old API" in e["event"] for e in events)
    assert all(e["stage"] == "decode" and e["replica"] == 1 and "timestamp" in e for e in events)


def test_console_format_renders_the_standard_library_s_lines_as_structlog_s(capsys, restore_logging):
    configure_logging("console", "info", stage="prefill")
    logging.getLogger("pdflow.kernels").warning("falling back to plain C")
    configure_logging("console", "info", stage="prefill")  # again: still one handler, one line each
    logging.getLogger("pdflow.kernels").warning("once")
    err = capsys.readouterr().err
    assert "falling back to plain C" in err and "pdflow.kernels" in err and "stage=prefill" in err
    assert err.count("once") == 1


def test_transformers_is_imported_only_by_code_that_uses_it_and_then_logs_through_the_pipeline(model_dir):
    """Importing transformers costs a process about 1.3 s of CPU: configuring logging must not
    (the launcher and most stages never use it); the ingress that loads a tokenizer does, and then
    transformers' records are JSON lines like the rest, with no progress bars."""
    code = f"""
import logging, sys
from pdflow.log import configure_logging
configure_logging("json", "info", stage="ingress")
assert "transformers" not in sys.modules, "configure_logging imported transformers"
from pdflow.tokenizing import load_tokenizer
load_tokenizer({str(model_dir)!r})
from transformers.utils import logging as hf_logging
assert not hf_logging.is_progress_bar_enabled()
hf_logging.get_logger("transformers.tokenization_utils_base").error("a record of transformers")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    record = next(e for e in events if e["event"] == "a record of transformers")
    assert record["logger"] == "transformers.tokenization_utils_base" and record["stage"] == "ingress"
