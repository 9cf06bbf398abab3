"""Where each layer's keys and values sit in one request's KV buffer, and the chunk checksum.

A request's KV buffer holds, for every layer, its keys then its values, each block in the memory
order the model produces it, so prefill sends straight from the tensors it computed:

- keys   ``(kv_heads, tokens, head_dim)``: rotary embedding writes keys head-major;
- values ``(tokens, kv_heads, head_dim)``: the value projection writes them token-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdflow.kv.checksum import checksum

__all__ = ["KEYS", "VALUES", "KvLayout", "checksum", "dtype_name", "torch_dtype"]

KEYS, VALUES = 0, 1

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

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    def block_bytes(self, num_tokens: int) -> int:
        """Bytes of one layer's keys (or values) for ``num_tokens`` tokens."""
        return num_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    def request_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * self.block_bytes(num_tokens)

    def offset(self, num_tokens: int, layer: int, kind: int) -> int:
        return (2 * layer + kind) * self.block_bytes(num_tokens)

    def shape(self, num_tokens: int, kind: int) -> tuple[int, int, int]:
        if kind == KEYS:
            return (self.num_kv_heads, num_tokens, self.head_dim)
        return (num_tokens, self.num_kv_heads, self.head_dim)

    def views(self, buffer: torch.Tensor, num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as ``(kv_heads, tokens, head_dim)`` views into a flat
        uint8 buffer laid out as above (values are transposed back without a copy)."""
        dtype = torch_dtype(self.dtype)
        size = self.block_bytes(num_tokens)
        out = []
        for kind in (KEYS, VALUES):
            start = self.offset(num_tokens, layer, kind)
            block = buffer[start : start + size].view(dtype).view(self.shape(num_tokens, kind))
            out.append(block if kind == KEYS else block.transpose(0, 1))
        return out[0], out[1]
