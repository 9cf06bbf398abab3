"""Typed reads from a decoded TOML document, with errors that name the file, line and key.

:class:`TableReader` does the checks every config section needs (unknown keys with a "did you
mean" hint, types, ranges, choices) so that :mod:`pdflow.config.topology` only states *what* it expects.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pdflow.config.toml_lines import LineMap


class TopologyError(Exception):
    """A topology file that cannot be used: ``str(e) == "{path}:{line}: {key}: {message}"``.

    ``line`` is None when unknown (the ``:line`` part is then left out); ``key`` is a dotted path
    such as ``stages.decode.cores`` or ``links[1].transport``. ``exit_code`` is what a command
    line tool should exit with.
    """

    exit_code = 2

    def __init__(self, path: str | Path, line: int | None, key: str, message: str) -> None:
        super().__init__(path, line, key, message)  # all four in args: survives pickling
        self.path, self.line, self.key, self.message = Path(path), line, key, message

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path}"
        return f"{where}: {self.key}: {self.message}"


def describe(value: Any) -> str:
    """``string "2"``, ``boolean true``, ``array ["a"]``: what a value is, in TOML words."""
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    kind = {int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(type(value))
    if kind is None:
        return f"{type(value).__name__} {value}"
    text = json.dumps(value, default=str) if kind in ("string", "array", "table") else str(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _bounds(ge: float | None, gt: float | None, lt: float | None, le: float | None) -> str:
    parts = [f"{op} {v}" for op, v in ((">=", ge), (">", gt), ("<", lt), ("<=", le)) if v is not None]
    return " and ".join(parts)


def syntax_error(path: Path, lines: LineMap, error: tomllib.TOMLDecodeError, text: str) -> TopologyError:
    """Turn tomllib's error (position only in its message, on Python 3.11) into a TopologyError."""
    message = str(error)
    match = re.search(r"\(at line (\d+), column \d+\)", message)
    line = int(match.group(1)) if match else (text.count("\n") + 1 if "end of document" in message else None)
    key = (lines.key_at(line) if line is not None else "") or "(document)"
    return TopologyError(path, line, key, f"invalid TOML: {message}")


class TableReader:
    """Reads typed values out of nested dicts; every failure is a :class:`TopologyError`."""

    def __init__(self, path: Path, lines: LineMap) -> None:
        self.path, self.lines = path, lines

    def error(self, key: str, message: str) -> TopologyError:
        flag = self.lines.flag_of(key)
        if flag is not None:
            message = f"{message} (given by {flag})"
        return TopologyError(self.path, self.lines.line_of(key), key, message)

    def check_keys(self, table: dict[str, Any], prefix: str, allowed: Collection[str]) -> None:
        for name in table:
            if name in allowed:
                continue
            close = difflib.get_close_matches(name, list(allowed), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"expected one of: {', '.join(allowed)}"
            raise self.error(join(prefix, name), f"unknown key '{name}'; {hint}")

    def table(self, parent: dict[str, Any], prefix: str, name: str, allowed: Collection[str]) -> dict[str, Any]:
        """The sub-table ``name`` of ``parent`` ({} when missing), its keys checked."""
        key = join(prefix, name)
        value = parent.get(name, {})
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table, got {describe(value)}")
        self.check_keys(value, key, allowed)
        return value

    def integer(
        self, table: dict[str, Any], prefix: str, name: str, default: int,
        *, ge: int | None = None, gt: int | None = None, lt: int | None = None, le: int | None = None,
    ) -> int:
        value = table.get(name, default)
        return self.check_integer(value, join(prefix, name), ge=ge, gt=gt, lt=lt, le=le)

    def check_integer(
        self, value: Any, key: str, *, what: str = "an integer",
        ge: int | None = None, gt: int | None = None, lt: int | None = None, le: int | None = None,
    ) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected {what}, got {describe(value)}")
        self._check_range(value, key, what, ge, gt, lt, le)
        return value

    def number(
        self, table: dict[str, Any], prefix: str, name: str, default: float,
        *, ge: float | None = None, gt: float | None = None, lt: float | None = None,
    ) -> float:
        """A float; integers are accepted too (``request_timeout_s = 300``), booleans are not."""
        key, value = join(prefix, name), table.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise self.error(key, f"expected a number, got {describe(value)}")
        self._check_range(value, key, "a number", ge, gt, lt, None)
        return float(value)

    def boolean(self, table: dict[str, Any], prefix: str, name: str, default: bool) -> bool:
        key, value = join(prefix, name), table.get(name, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {describe(value)}")
        return value

    def string(
        self, table: dict[str, Any], prefix: str, name: str, default: str,
        *, choices: Collection[str] | None = None, non_empty: bool = False,
    ) -> str:
        key, value = join(prefix, name), table.get(name, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {describe(value)}")
        if choices is not None and value not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}, got {describe(value)}")
        if non_empty and not value.strip():
            raise self.error(key, "expected a non-empty string")
        return value

    def _check_range(
        self, value: float, key: str, what: str,
        ge: float | None, gt: float | None, lt: float | None, le: float | None,
    ) -> None:
        if (
            (ge is not None and value < ge) or (gt is not None and value <= gt)
            or (lt is not None and value >= lt) or (le is not None and value > le)
        ):
            raise self.error(key, f"expected {what} {_bounds(ge, gt, lt, le)}, got {value}")
