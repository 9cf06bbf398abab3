"""The arena: one preallocated memory of block slots, and where each byte of a slot sits.

The memory is ``(layers, 2, slots, block_tokens, kv_heads, head_dim)``: for every layer, a pool
of keys and a pool of values, each a row of slots, each slot ``block_tokens`` tokens token-major.
So the keys (or values) of one layer over a run of consecutive slots are one contiguous span: a
chunk on the wire is "layer l, keys, slots [a, b)" whatever the number of blocks, and the
request-buffer layout (:class:`~pdflow.kv.layout.KvLayout`) is the same token-major order, so a
chunk goes from a run of slots to a request buffer (and back) as one copy.

An arena may hold its blocks encoded (``codec``, :mod:`pdflow.kv.codecs`: the store's memory tier
in int8 holds 3.9x the blocks): a slot's keys (values) of one layer are then that block's
encoding, ``codec.encoded_bytes(block_tokens, kind, ...)`` bytes (keys and values may differ), and
a run of consecutive slots is the run's encoding, block after block, still one span.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdflow.kv.codecs import KvCodec
from pdflow.kv.layout import KEYS, KvLayout, torch_dtype

__all__ = ["ArenaLayout", "Run", "anonymous_memory", "runs"]


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    kv: KvLayout
    block_tokens: int
    num_slots: int
    codec: KvCodec | None = None  # None (or a lossless codec): the KV's own bytes

    @classmethod
    def for_capacity(cls, kv: KvLayout, block_tokens: int, capacity_bytes: int,
                     codec: KvCodec | None = None) -> "ArenaLayout":
        return cls(kv, block_tokens, capacity_bytes // cls(kv, block_tokens, 0, codec).block_bytes, codec)

    @property
    def encoded(self) -> bool:
        """Whether slots hold encodings (a lossy codec) rather than the KV's own bytes."""
        return self.codec is not None and not self.codec.lossless

    def span(self, kind: int) -> int:
        """Bytes of one slot's keys (``kind`` 0) or values (1) of one layer."""
        if self.encoded:
            kv = self.kv
            return self.codec.encoded_bytes(self.block_tokens, kind, kv.num_kv_heads, kv.head_dim, kv.itemsize)
        return self.kv.block_bytes(self.block_tokens)

    @property
    def slot_span(self) -> int:
        """Bytes of one slot's keys (or values) of one layer (raw arenas: both the same)."""
        if self.encoded:
            raise ValueError("an encoded arena's keys and values take different spans: use span(kind)")
        return self.span(KEYS)

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block (every layer, keys and values)."""
        return self.kv.num_layers * (self.span(0) + self.span(1))

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.block_bytes

    def offset(self, layer: int, kind: int, slot: int, token: int = 0) -> int:
        """Where token ``token`` of ``slot``'s keys (or values) of ``layer`` sits (``token`` must
        be 0 in an encoded arena: a block's encoding is not addressable by token)."""
        if token and self.encoded:
            raise ValueError("an encoded slot is not addressable by token")
        keys, values = self.span(0), self.span(1)
        return (self.num_slots * (layer * (keys + values) + (keys if kind else 0)) + slot * (values if kind else keys)
                + token * self.kv.token_bytes)

    def run_bytes(self, kind: int, tokens: int) -> int:
        """Bytes of ``tokens`` tokens' keys (or values) of one layer from a slot's start, as held here."""
        kv = self.kv
        if self.encoded:
            return self.codec.run_bytes(tokens, kind, kv.num_kv_heads, kv.head_dim, kv.itemsize, self.block_tokens)
        return tokens * kv.token_bytes

    def view(self, memory: torch.Tensor) -> torch.Tensor:
        """The arena's memory (flat uint8) as ``(layers, 2, slots, block_tokens, kv_heads, head_dim)``
        (ValueError for an encoded arena)."""
        if self.encoded:
            raise ValueError(f"the arena's blocks are encoded ({self.codec.spec}): there is no tensor view of them")
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

