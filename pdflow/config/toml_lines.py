"""Map dotted TOML key paths to the line that defines them.

``tomllib`` returns plain dicts without positions, so error messages would not be able to point at
a line. :class:`LineMap` scans the text once, line by line, for table headers (``[a.b]``,
``[[links]]`` with its array index) and ``key =`` lines (dotted keys included), and records the
first line of each path. Values spanning several lines (arrays, inline tables, multi-line strings)
are skipped over, so text inside them is never mistaken for a key. Keys inside a one-line inline
table are not recorded: :meth:`LineMap.line_of` falls back to the closest recorded parent, which
is the line of the key that holds the inline table, or the header of the table.

Paths look like ``stages.decode.cores`` and ``links[1].transport`` (array indices count from 0).
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^\s*(\[\[?)(.+?)\]\]?\s*(?:#.*)?$")
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_PART = re.compile(_KEY_PART)


def _parts(dotted: str) -> list[str]:
    """Split ``a."b.c".d`` into ``["a", "b.c", "d"]``."""
    return [p[1:-1] if p[0] in "\"'" else p for p in _PART.findall(dotted)]


def parent_key(key: str) -> str:
    """``links[1].options.x`` -> ``links[1].options`` -> ``links[1]`` -> ``links`` -> ``""``."""
    if key.endswith("]"):
        return key[: key.rindex("[")]
    return key.rpartition(".")[0]


def _advance(text: str, depth: int, open_string: str | None) -> tuple[int, str | None]:
    """Scan ``text`` and return the bracket depth and open multi-line string delimiter after it."""
    i = 0
    while i < len(text):
        if open_string:
            end = text.find(open_string, i)
            if end < 0:
                return depth, open_string
            i, open_string = end + 3, None
            continue
        c = text[i]
        if c == "#":
            break
        if text.startswith('"""', i) or text.startswith("'''", i):
            open_string, i = text[i : i + 3], i + 3
            continue
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if c == '"' and text[j] == "\\" else 1
            i = j + 1
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        i += 1
    return depth, open_string


class LineMap:
    """Line numbers (1-based) of the keys and table headers in one TOML text."""

    def __init__(self, text: str) -> None:
        self._text_lines = text.splitlines()
        self._lines: dict[str, int] = {}
        self._entries: list[tuple[int, str, bool]] = []  # (line, path, is_header)
        self._flags: dict[str, str] = {}  # key -> the command-line flag that set it
        array_counts: dict[str, int] = {}
        table = ""
        depth, open_string = 0, None
        for number, line in enumerate(self._text_lines, start=1):
            if open_string or depth > 0:
                depth, open_string = _advance(line, depth, open_string)
                continue
            header = _HEADER.match(line)
            if header:
                table = self._table_path(_parts(header.group(2)), header.group(1) == "[[", array_counts)
                self._record(table, number, is_header=True)
                continue
            key = _KEY.match(line)
            if key:
                path = table
                for part in _parts(key.group(1)):
                    path = f"{path}.{part}" if path else part
                    self._record(path, number, is_header=False)
                depth, open_string = _advance(line[key.end() :], 0, None)

    @staticmethod
    def _table_path(parts: list[str], is_array: bool, array_counts: dict[str, int]) -> str:
        path = ""
        for i, part in enumerate(parts):
            path = f"{path}.{part}" if path else part
            if is_array and i == len(parts) - 1:
                array_counts[path] = array_counts.get(path, 0) + 1
            if path in array_counts:  # [[links]] then [links.options]: the latest element
                path = f"{path}[{array_counts[path] - 1}]"
        return path

    def _record(self, path: str, line: int, *, is_header: bool) -> None:
        self._lines.setdefault(path, line)
        self._entries.append((line, path, is_header))

    def set_by(self, key: str, flag: str) -> None:
        """``key`` comes from the command line (``flag``), not from a line of the file."""
        self._flags[key] = flag

    def flag_of(self, key: str) -> str | None:
        """The command-line flag that set ``key``, a parent of it or a key inside it, else None."""
        inside = next((flag for given, flag in self._flags.items() if given.startswith(f"{key}.")), None)
        while key:
            if key in self._flags:
                return self._flags[key]
            key = parent_key(key)
        return inside

    def line_of(self, key: str) -> int | None:
        """The line of ``key``, else of its closest recorded parent, else None."""
        if self.flag_of(key) is not None:
            return None
        while key:
            if key in self._lines:
                return self._lines[key]
            key = parent_key(key)
        return None

    def key_at(self, line: int) -> str:
        """The deepest key defined on ``line``, else the table that ``line`` is in ("" at top).

        For syntax errors: a broken header (``[stages.decode``) is named after its own text.
        """
        on_line = [path for number, path, _ in self._entries if number == line]
        if on_line:
            return on_line[-1]
        text = self._text_lines[line - 1].strip() if 0 < line <= len(self._text_lines) else ""
        if text.startswith("["):
            return ".".join(_parts(text.split("#")[0])) or text
        headers = [path for number, path, is_header in self._entries if is_header and number < line]
        return headers[-1] if headers else ""
