"""What the experiments (``experiments/`` of a checkout) share: their argument parser and common
flags, the trace they replay, a ``pdflow run`` to measure, the command that repeats a run, a report
printed as it goes and kept for summary.md, and ``pdflow bench serve`` run in-process.

Paths are the checkout's: ``ROOT`` is the directory that holds ``pdflow/`` and ``experiments/``,
results go under ``ROOT/bench-results/`` by default, and the trace is read from ``TRACE``
(``../shared/traces/`` beside the checkout, as on the development machine) unless ``--trace``
names another; :mod:`pdflow.bench.traces` says where to get one (Mooncake's, Apache-2.0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pdflow.bench import traces

if TYPE_CHECKING:
    from pdflow.testing.server import PdflowServer

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / traces.NAMES[0]


def experiment_parser(doc: str, out: str | None = None) -> argparse.ArgumentParser:
    """An experiment's argument parser: ``doc`` (its module docstring) as the description, its
    layout kept; with ``out``, an ``--out`` directory defaulting to ``ROOT/bench-results/<out>``."""
    made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        made.add_argument("--out", type=Path, default=ROOT / "bench-results" / out,
                          help="where summary.md and the raw results go (default: %(default)s)")
    return made


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """``--trace FILE``: the Mooncake-format trace to replay, defaulting to ``TRACE``; its help
    names the traces' source and licence and how to fetch one."""
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help=traces.help_text("the Mooncake-format trace to replay (default: %(default)s)"))


def require_trace(path: Path) -> Path:
    """``path`` when the trace is there; else exit (SystemExit) with a message naming the traces'
    source and licence and the command that fetches one. Called before the parts that need it run."""
    try:
        return traces.existing(path)
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None


def add_slo_arguments(parser: argparse.ArgumentParser, ttft_ms: float, tbt_ms: float) -> None:
    """``--slo-ttft`` and ``--slo-tbt`` (milliseconds), with this experiment's defaults."""
    parser.add_argument("--slo-ttft", type=float, default=ttft_ms, help="TTFT SLO, ms (default: %(default)s)")
    parser.add_argument("--slo-tbt", type=float, default=tbt_ms, help="TBT SLO, ms (default: %(default)s)")


@contextlib.contextmanager
def serving(**options) -> Iterator[PdflowServer]:
    """A ``pdflow run`` of the test topology (``PdflowServer(**options)``) in a temporary
    directory, ready on entry and stopped, its directory removed, on exit."""
    from pdflow.testing.server import PdflowServer

    with tempfile.TemporaryDirectory() as tmp, PdflowServer(Path(tmp), **options) as started:
        yield started


def command(argv: list[str] | None = None) -> str:
    """The shell command that repeats this run from the checkout's root (``argv``: ``sys.argv``)."""
    script, *args = argv or sys.argv
    path = Path(script).resolve()
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else script
    return shlex.join([".venv/bin/python", shown, *args])


class Report:
    """Lines printed at once and kept, to be written as one markdown file at the end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: Path) -> None:
        path.write_text("\n".join(self.lines) + "\n")

    def header(self, title: str) -> None:
        """The report's first lines: ``title`` with the date, the load and the cores, then the
        command that repeats this run."""
        self.say(f"# {title} ({time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}, "
                 f"{os.cpu_count()} cores)")
        self.say(f"command: {command()}")

    def run(self, title: str, parts: dict[str, Callable], opts) -> int:
        """Run the parts named in ``opts.parts`` (comma-separated), each ``part(opts, opts.out)``
        under its own heading, then write ``opts.out/summary.md``."""
        opts.out.mkdir(parents=True, exist_ok=True)
        self.header(title)
        for name in opts.parts.split(","):
            self.say()
            self.say(f"## {name}")
            parts[name](opts, opts.out)
        self.write(opts.out / "summary.md")
        self.say()
        self.say(f"written: {opts.out / 'summary.md'}")
        return 0


def figure(value, spec: str = ".0f") -> str:
    """A figure for a table; "-" where a cell has none (e.g. every request of it failed)."""
    return "-" if value is None else format(value, spec)


def bench(url: str, out: Path, argv: list[str]) -> dict:
    """``pdflow bench serve --base-url url ... argv``; the result JSON (also written to ``out``)."""
    from pdflow.bench.serve import main, parse_args

    args = parse_args(["--base-url", url, "--no-progress", "--result-json", str(out), *argv])
    main(args)
    return json.loads(out.read_text())


def one_prompt_timeline(url: str, tokens: int, variant: int = 0) -> dict:
    """Send one ``tokens``-token prompt (plain token ids, no special tokens) for two tokens; its
    timeline (``/debug/timeline``): what KV-tail measurements read. Each ``variant`` is another
    prompt from its first token (none is a prefix another stored)."""
    import httpx

    prompt = [(i * 7919 + variant * 104729) % 40000 + 1000 for i in range(tokens)]
    reply = httpx.post(f"{url}/v1/completions", timeout=900,
                       json={"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                             "ignore_eos": True}).json()
    if "id" not in reply:
        raise RuntimeError(f"the {tokens}-token request failed: {reply}")
    return httpx.get(f"{url}/debug/timeline/{reply['id']}", timeout=30).json()
