"""The ``none`` codec: KV bytes as they are (the default on every link and tier)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow.kv.codecs.base import KvCodec, torch_module

if TYPE_CHECKING:
    import torch

__all__ = ["NoCodec"]


class NoCodec(KvCodec):
    name = "none"
    lossless = True

    def encoded_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                      layer: int = 0) -> int:
        return tokens * kv_heads * head_dim * itemsize

    def encode_blocks(self, blocks: torch.Tensor, kind: int, layer: int = 0) -> torch.Tensor:
        return blocks.contiguous().view(torch_module().uint8).reshape(blocks.shape[0], -1)

    def encode_run(self, chunk: torch.Tensor, kind: int, block_tokens: int, layer: int = 0) -> torch.Tensor:
        return chunk.contiguous().view(torch_module().uint8).reshape(-1)  # the bytes themselves: no copy

    def decode_blocks(self, data: torch.Tensor, kind: int, out: torch.Tensor, layer: int = 0) -> None:
        out.view(out.shape[0], -1).view(torch_module().uint8).copy_(data)
