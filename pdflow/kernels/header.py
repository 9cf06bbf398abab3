"""``pdflow_kernels.h`` read as Python needs it: every function's prototype (from which
:func:`pdflow.kernels.declare` sets each ctypes function's argtypes and restype) and every
struct's fields (which the ctypes Structures in :mod:`pdflow.kernels` must match; a test holds
them to it).

The header is the C this reads and nothing more: comments, ``#`` lines, ``typedef struct { ... }
name;`` with one field per declaration, and prototypes ``TYPE name(TYPE name, ...);`` with every
parameter named. Types are normalized to their base name and their stars, ``const`` dropped:
``const float *x`` -> ``float *``, ``float *const *keys`` -> ``float **``. Anything else in the
header raises ValueError naming it, so the header cannot say more than Python reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

HEADER = Path(__file__).with_name("pdflow_kernels.h")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DIRECTIVE = re.compile(r"^[ \t]*#[^\n]*$", re.MULTILINE)
_STRUCT = re.compile(r"typedef\s+struct\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;")
_PROTOTYPE = re.compile(r"(?P<result>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<parameters>[^()]*)\)", re.DOTALL)
_DECLARATION = re.compile(r"(?P<type>[\w\s*]+?)\s*\b(?P<name>\w+)", re.DOTALL)


class Declaration(NamedTuple):
    """A parameter or a struct field: its normalized type (``"int64_t"``, ``"float *"``) and name."""

    type: str
    name: str


class Prototype(NamedTuple):
    """A function of the header: its name, its result's normalized type, its parameters in order."""

    name: str
    result: str
    parameters: tuple[Declaration, ...]


class Header(NamedTuple):
    """What the header declares, in the order it declares it."""

    structs: dict[str, tuple[Declaration, ...]]
    prototypes: dict[str, Prototype]


def normalize(c_type: str) -> str:
    """``c_type`` without ``const``, as its base name and a star per pointer level."""
    words = c_type.replace("*", " * ").split()
    stars = words.count("*")
    base = " ".join(w for w in words if w not in ("*", "const"))
    if not base:
        raise ValueError(f"no type in {c_type!r}")
    return base + (" " + "*" * stars if stars else "")


def _declaration(text: str, where: str) -> Declaration:
    match = _DECLARATION.fullmatch(text.strip())
    if match is None or not match.group("type").strip():
        raise ValueError(f"{where}: cannot read {text.strip()!r} as one named declaration")
    return Declaration(normalize(match.group("type")), match.group("name"))


def read(text: str | None = None) -> Header:
    """The structs and prototypes of ``text`` (default: the package's ``pdflow_kernels.h``)."""
    text = HEADER.read_text() if text is None else text
    text = _DIRECTIVE.sub("", _COMMENT.sub(" ", text))
    structs: dict[str, tuple[Declaration, ...]] = {}
    for match in _STRUCT.finditer(text):
        fields = [f for f in match.group("body").split(";") if f.strip()]
        structs[match.group("name")] = tuple(_declaration(f, f"struct {match.group('name')}") for f in fields)
    prototypes: dict[str, Prototype] = {}
    for statement in _STRUCT.sub("", text).split(";"):
        if not statement.strip():
            continue
        match = _PROTOTYPE.fullmatch(statement.strip())
        if match is None:
            raise ValueError(f"{HEADER.name}: cannot read {' '.join(statement.split())!r} as a prototype")
        name, listed = match.group("name"), match.group("parameters").strip()
        parameters = () if listed in ("", "void") else tuple(_declaration(p, name) for p in listed.split(","))
        prototypes[name] = Prototype(name, normalize(match.group("result")), parameters)
    return Header(structs, prototypes)
