"""The arena: one preallocated memory of block slots, and where each byte of a slot sits.

The memory is ``(layers, 2, slots, block_tokens, kv_heads, head_dim)``: for every layer, a pool
of keys and a pool of values, each a row of slots, each slot ``block_tokens`` tokens token-major.
So the keys (or values) of one layer over a run of consecutive slots are one contiguous span: a
chunk on the wire is "layer l, keys, slots [a, b)" whatever the number of blocks, and the
request-buffer layout (:class:`~pdflow.kv.layout.KvLayout`) is the same token-major order, so a
chunk goes from a run of slots to a request buffer (and back) as one copy.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdflow.kv.layout import KvLayout, torch_dtype

__all__ = ["ArenaLayout", "Run", "anonymous_memory", "runs"]


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    kv: KvLayout
    block_tokens: int
    num_slots: int

    @classmethod
    def for_capacity(cls, kv: KvLayout, block_tokens: int, capacity_bytes: int) -> "ArenaLayout":
        slots = capacity_bytes // (2 * kv.num_layers * kv.block_bytes(block_tokens))
        return cls(kv, block_tokens, slots)

    @property
    def slot_span(self) -> int:
        """Bytes of one slot's keys (or values) of one layer."""
        return self.kv.block_bytes(self.block_tokens)

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block (every layer, keys and values)."""
        return 2 * self.kv.num_layers * self.slot_span

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.block_bytes

    def offset(self, layer: int, kind: int, slot: int, token: int = 0) -> int:
        """Where token ``token`` of ``slot``'s keys (or values) of ``layer`` sits."""
        return ((2 * layer + kind) * self.num_slots + slot) * self.slot_span + token * self.kv.token_bytes

    def view(self, memory: torch.Tensor) -> torch.Tensor:
        """The arena's memory (flat uint8) as ``(layers, 2, slots, block_tokens, kv_heads, head_dim)``."""
        kv = self.kv
        shape = (kv.num_layers, 2, self.num_slots, self.block_tokens, kv.num_kv_heads, kv.head_dim)
        return memory[: self.nbytes].view(torch_dtype(kv.dtype)).view(shape)


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive slots from ``slot``, holding tokens ``[token_start, token_end)``."""

    slot: int
    count: int
    token_start: int
    token_end: int


def runs(slots: list[int], first_token: int, end_token: int, block_tokens: int) -> Iterator[Run]:
    """Tokens ``[first_token, end_token)`` held by ``slots`` (slot *i* holds block
    ``first_token // block_tokens + i``; ``first_token`` is block-aligned) cut into runs of
    consecutive slots: one chunk per run per layer and kind."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        start = first_token + i * block_tokens
        end = min(first_token + j * block_tokens, end_token)
        if start >= end:
            return
        yield Run(slots[i], j - i, start, end)
        i = j


def anonymous_memory(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed process memory, mapped lazily: pages nothing touched cost nothing."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))

