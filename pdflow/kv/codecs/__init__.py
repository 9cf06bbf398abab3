"""KV codecs: how KV is encoded on a data-plane link or in a store tier.

A link's or tier's ``codec`` in a topology names one, with parameters as a table (``codec =
"int8"``, ``codec_options = { key_group = 32 }``). Third-party codecs register under the
entry-point group ``pdflow.kv_codecs`` (a :class:`KvCodec` subclass). Chunk headers carry
:attr:`KvCodec.spec`; :func:`from_spec` turns it back into the codec, or raises ValueError
naming what this process does not know.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pdflow.kv.codecs.base import KvCodec
from pdflow import plugins

registry = plugins.kv_codecs
BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "KvCodec", "codec", "from_spec", "registry"]


def codec(name: str, **params: Any) -> KvCodec:
    """The codec ``name`` with ``params`` (LookupError: unknown name; TypeError / ValueError: bad
    parameters, named)."""
    return registry.load(name)(**params)


@lru_cache(maxsize=64)  # every encoded chunk's header names its codec: parse each spec once
def from_spec(spec: str) -> KvCodec:
    """The codec a chunk header's ``spec`` describes (ValueError if unknown here or malformed).
    The same object for the same spec: do not change its ``params``."""
    name, _, rest = spec.partition(":")
    try:
        cls = registry.load(name)
    except (LookupError, ImportError) as exc:
        raise ValueError(f"KV encoded with codec {spec!r}, which this process cannot decode: {exc}") from None
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, text = item.partition("=")
        if not eq or key not in cls.defaults:
            raise ValueError(f"codec spec {spec!r}: {item!r} is not a parameter of {name} "
                             f"(known: {', '.join(sorted(cls.defaults)) or 'none'})")
        kind = type(cls.defaults[key])
        try:
            params[key] = bool(int(text)) if kind is bool else kind(text)
        except ValueError:
            raise ValueError(f"codec spec {spec!r}: {key}={text!r} is not a {kind.__name__}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
