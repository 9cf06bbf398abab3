"""Command-line overrides of a topology: ``pdflow run [TOPOLOGY] --model M --port N --set
key.path=value``.

Each override is a dotted key (``server.port``, ``stages.decode.replicas``) and a value, written
into the TOML tables before they are read, so it is checked exactly as the same key in the file
would be; an error about it names the flag that gave it instead of a line. ``--set`` values are
TOML values (``8001``, ``true``, ``"text"``, ``[0, 1]``); one that is not TOML is a string.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from typing import Any

_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


class OverrideError(ValueError):
    """A malformed override (the flag's text is at fault, not the topology)."""


@dataclass(frozen=True, slots=True)
class Override:
    key: str  # dotted: server.port
    value: Any
    flag: str  # as the user wrote it: --port 8001, --set server.port=8001


def parse_set(text: str) -> Override:
    """``key.path=value`` (``--set``)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise OverrideError(f"--set {text}: expected KEY.PATH=VALUE, e.g. --set server.port=8001")
    return Override(key, toml_value(value.strip()), f"--set {text}")


def toml_value(text: str) -> Any:
    """``text`` read as a TOML value; a string if it is not one (``--set model.source=./m``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply(raw: dict[str, Any], overrides: list[Override]) -> None:
    """Write each override into ``raw`` (the topology's tables), making the tables it needs."""
    for override in overrides:
        *tables, name = override.key.split(".")
        table = raw
        for i, part in enumerate(tables):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise OverrideError(f"{override.flag}: {'.'.join(tables[: i + 1])} is not a table in the topology")
        table[name] = override.value
