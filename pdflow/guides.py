"""A guide: the grammar a request's output must follow, as it travels in
``SamplingParams.guide`` (JSON text), and its check. Plain data, no engine: ingress checks a
guide compiles before it admits the request; the engine's :mod:`pdflow.engine.guided` runs it.
The grammar engine is llguidance.
"""

from __future__ import annotations

import json
from typing import Any


def guide_text(kind: str, schema: Any = None) -> str:
    """A guide as it travels: ``kind`` "json_object" (any JSON object) or "json_schema"
    (``schema``, a JSON schema as a dict)."""
    if kind == "json_object":
        return json.dumps({"json_schema": {"type": "object"}})
    if kind == "json_schema":
        return json.dumps({"json_schema": _machine_numbers(schema)}, sort_keys=True)
    raise ValueError(f"unknown guide kind {kind!r}")


def _machine_numbers(value: Any) -> Any:
    """The schema with integers past 64 bits as floats (the same numbers to JSON Schema; the
    grammar engine reads 64-bit integers only)."""
    if isinstance(value, dict):
        return {key: _machine_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_machine_numbers(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return float(value)
    return value


def grammar(text: str) -> str:
    import llguidance

    spec = json.loads(text)
    return llguidance.LLMatcher.grammar_from_json_schema(spec["json_schema"],
                                                         defaults={"whitespace_flexible": False})


def guide_error(text: str) -> str | None:
    """Why the guide cannot be compiled or enforced whole, or None (a warning counts: a
    schema keyword llguidance would not enforce is refused rather than ignored)."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar(text))
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    if is_error or messages:
        return "; ".join(messages) or "invalid"
    return None
