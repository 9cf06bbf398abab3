"""Where each layer's keys and values sit in one request's KV buffer, and the chunk checksum.

A request's KV buffer holds, for every layer, its keys then its values, both token-major
``(tokens, kv_heads, head_dim)``: the layout of the store's block slots (:mod:`pdflow.kv.arena`),
so any run of tokens of one layer's keys (or values) is one contiguous span, in a request buffer
and in a run of consecutive slots alike. The value projection writes values token-major already;
keys come out of rotary embedding head-major, so prefill transposes them once (a copy far cheaper
than the layer that computed them) and attention reads them back as a strided view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pdflow.transports.checksum import checksum
from pdflow.kv.kinds import KEYS, VALUES

__all__ = ["KEYS", "VALUES", "KvLayout", "checksum", "dtype_name", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @classmethod
    def from_config(cls, config, dtype: str = "float32") -> "KvLayout":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str = "float32") -> "KvLayout":
        """From a model directory's ``config.json``, read as plain JSON: a stage that only needs
        the shape of the KV need not import transformers (seconds of start-up)."""
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the model's shape from {path}: {exc}") from None
        return cls.from_config(SimpleNamespace(**config), dtype)

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    def block_bytes(self, num_tokens: int) -> int:
        """Bytes of one layer's keys (or values) for ``num_tokens`` tokens."""
        return num_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    def request_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * self.block_bytes(num_tokens)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys (or values) in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    def offset(self, num_tokens: int, layer: int, kind: int, token: int = 0) -> int:
        """Where token ``token`` of ``layer``'s keys (or values) sits in a ``num_tokens`` buffer."""
        return (2 * layer + kind) * self.block_bytes(num_tokens) + token * self.token_bytes

    def shape(self, num_tokens: int, kind: int = KEYS) -> tuple[int, int, int]:
        return (num_tokens, self.num_kv_heads, self.head_dim)

    def views(self, buffer: torch.Tensor, num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as ``(kv_heads, tokens, head_dim)`` views into a flat
        uint8 buffer laid out as above (transposed from token-major without a copy)."""
        dtype = torch_dtype(self.dtype)
        size = self.block_bytes(num_tokens)
        out = []
        for kind in (KEYS, VALUES):
            start = self.offset(num_tokens, layer, kind)
            out.append(buffer[start : start + size].view(dtype).view(self.shape(num_tokens)).transpose(0, 1))
        return out[0], out[1]
