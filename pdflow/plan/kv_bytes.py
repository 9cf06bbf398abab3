"""KV bytes per token and per request, for each KV dtype and each of pdflow's quantizing codecs.

Plain dtypes: ``elements_per_token x itemsize``. A codec (``int8``, ``int4``) is sized by the
codec itself (:meth:`pdflow.kv.codecs.KvCodec.encoded_bytes`, scales included) on blocks of
``block_tokens`` tokens, keys and values, every layer, so these figures are the bytes pdflow
puts on a link or in an encoded store tier. Codecs that drop KV (``head-prune``,
``sink-window``) keep a share that depends on their settings and are not tabled here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.plan.shapes import ModelShape

__all__ = ["DTYPES", "CODECS", "KvSize", "kv_sizes", "size_of"]

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
CODECS = ("int8", "int4")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float8": "fp8"}


@dataclass(frozen=True, slots=True)
class KvSize:
    label: str  # "bfloat16", or "int8 (codec)"
    bytes_per_token: float | None  # None: not covered for this model (why in note)
    note: str = ""

    def bytes_for(self, tokens: int) -> float | None:
        return None if self.bytes_per_token is None else self.bytes_per_token * tokens


def _dtype(name: str) -> str:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; known: {', '.join(DTYPES)}")
    return key


def size_of(shape: ModelShape, kv: str, block_tokens: int = 64) -> KvSize:
    """One row: a dtype (``"bfloat16"``, ``"fp16"``, ...) or a codec (``"int8"``, ``"int4"``)."""
    if kv in CODECS:
        return _codec_size(shape, kv, block_tokens)
    key = _dtype(kv)
    return KvSize(key, float(shape.elements_per_token * DTYPES[key]))


def _codec_size(shape: ModelShape, name: str, block_tokens: int) -> KvSize:
    if shape.attention != "gqa":
        return KvSize(f"{name} (codec)", None, "pdflow's codecs encode keys and values per kv head: "
                      "an MLA latent is not covered")
    from pdflow.kv.codecs import codec
    from pdflow.kv.kinds import KEYS, VALUES

    encoder = codec(name)
    try:
        per_block = sum(encoder.encoded_bytes(block_tokens, kind, shape.kv_heads, shape.head_dim, 2)
                        for kind in (KEYS, VALUES))
    except ValueError as exc:  # e.g. int4 on an odd number of channels
        return KvSize(f"{name} (codec)", None, str(exc))
    return KvSize(f"{name} (codec)", per_block * shape.layers / block_tokens,
                  f"scales included, blocks of {block_tokens} tokens")


def kv_sizes(shape: ModelShape, block_tokens: int = 64, dtypes: tuple[str, ...] = tuple(DTYPES),
             codecs: tuple[str, ...] = CODECS) -> list[KvSize]:
    """Every dtype's row, then every codec's."""
    return [size_of(shape, kv, block_tokens) for kv in (*dtypes, *codecs)]
