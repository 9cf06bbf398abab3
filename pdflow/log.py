"""structlog set-up shared by the launcher and every stage: readable lines or JSON."""

from __future__ import annotations

import logging
import sys

import structlog


class _StderrLogger:
    """Writes each line to whatever ``sys.stderr`` is at that moment (a logger that kept the
    stream of configure time would write to a closed file once a test harness swapped it)."""

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = err = msg


def _stderr_logger(*_args) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(fmt: str = "console", level: str = "info", **context) -> None:
    """Configure structlog for this process; ``context`` (e.g. stage, replica) is on every line."""
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S.%f"),
            structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    for noisy in ("transformers", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:  # no "Loading weights" bars in stage logs
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
