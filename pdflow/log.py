"""structlog set-up shared by the launcher and every stage: readable lines or JSON.

One pipeline for every line a process logs: structlog's own loggers, and the standard library's
(the kernels' loader, the packed-weights cache, uvicorn, ZeroMQ's authenticator, ``warnings``),
whose records go through the same renderer by structlog's ``ProcessorFormatter``, so that with
``--log-format json`` every line on stderr is one JSON object.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False  # configure_logging ran in this process


class _StderrLogger:
    """Writes each line to whatever ``sys.stderr`` is at that moment (a logger that kept the
    stream of configure time would write to a closed file once a test harness swapped it)."""

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = err = msg


def _stderr_logger(*_args) -> _StderrLogger:
    return _StderrLogger()


class _StderrHandler(logging.Handler):
    """The standard library's records, formatted, to whatever ``sys.stderr`` is at that moment."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a log line must never take the process down
            self.handleError(record)


def _renderer(fmt: str):
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)


def configure_logging(fmt: str = "console", level: str = "info", **context) -> None:
    """Configure structlog, and the standard library's logging through it, for this process;
    ``context`` (e.g. stage, replica) is on every line."""
    renderer = _renderer(fmt)
    stamp = structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S.%f")
    exceptions = structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info
    numeric_level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, stamp, exceptions,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    _route_stdlib(renderer, stamp, numeric_level, fmt)
    for noisy in ("transformers", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    global _configured
    _configured = True
    if "transformers" in sys.modules:  # else quiet_transformers() runs where it is imported
        quiet_transformers()


def quiet_transformers() -> None:
    """transformers as a stage logs: no "Loading weights" bars, its records through the root
    handler (not its own). Called right after the import by the code that imports transformers,
    not by :func:`configure_logging`: importing it there cost every process (the launcher, each
    stage, most of which never use it) about 1.3 s of CPU at start. A process that did not
    configure logging (a notebook using the engine) keeps transformers' own set-up."""
    if not _configured:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def _route_stdlib(renderer, stamp, level: int, fmt: str) -> None:
    """The root logger's one handler: every standard-library record, rendered as structlog's."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
                           structlog.stdlib.add_logger_name, stamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([structlog.processors.format_exc_info] if fmt == "json" else []), renderer],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:  # (configured again)
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # warnings.warn(...) as records of "py.warnings". Off, then on: logging remembers that it
    # captures even after someone (a test harness's catch_warnings) restored warnings.showwarning,
    # and a second captureWarnings(True) would then do nothing.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
