"""The request traces pdflow replays, and where to get them.

They are Mooncake's: the traces released with the Mooncake FAST'25 paper, in the repository
kvcache-ai/Mooncake, folder ``FAST25-release/traces/`` (``conversation_trace.jsonl``,
``synthetic_trace.jsonl``), under the Apache License 2.0 (that repository's ``LICENSE-APACHE``).
One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per 512-token block of the prompt; no text. pdflow does not ship them:

    curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl

Every reader of a trace (``pdflow bench serve --dataset trace``, ``pdflow plan``, ``pdflow
simulate``, the experiments) checks the path with :func:`existing`, so a missing file says where
to get one.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = ("Mooncake's FAST'25 traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces/, "
          "Apache License 2.0)")
URL = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/{name}"
NAMES = ("conversation_trace.jsonl", "synthetic_trace.jsonl")  # what that folder holds


def fetch_command(name: str = NAMES[0]) -> str:
    """The shell command that downloads the trace ``name`` into the current directory."""
    return f"curl -LO {URL.format(name=name)}"


def help_text(what: str = "a Mooncake-format JSONL trace") -> str:
    """The ``--help`` line of a flag that takes a trace: ``what``, then its source and licence."""
    return f"{what}; e.g. {SOURCE}: {fetch_command()}"


def existing(path: str | Path) -> Path:
    """``path`` (``~`` expanded) when it is a file; else FileNotFoundError naming the path, the
    traces' source and licence, and the command that fetches one."""
    found = Path(path).expanduser()
    if not found.is_file():
        raise FileNotFoundError(f"{path}: no such trace file. The traces are {SOURCE}; fetch one with: "
                                f"{fetch_command(found.name if found.name in NAMES else NAMES[0])}")
    return found
