"""KV chunks between the store's slots and request buffers: which bytes, with which header.

A chunk is the keys (or values) of one layer over a run of tokens: from a tensor into a run of
consecutive slots of the arena (prefill writing a prompt's new blocks, decode writing an answer's
blocks), or from a run of slots into a request buffer (the store sending a cached prefix). Headers
carry the real token range, so a receiver counts what has landed by tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pdflow.kv.arena import ArenaLayout, runs
from pdflow.kv.checksum import checksum
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.messages import KvChunkHeader
from pdflow.transports.regions import byte_view

__all__ = ["from_slots", "header", "into_slots", "tokens_of_run"]


def header(request_id: str, layer: int, kind: int, token_start: int, token_end: int, kv: KvLayout, region: int,
           offset: int, data: memoryview) -> KvChunkHeader:
    return KvChunkHeader(request_id, layer, kind, token_start, token_end, kv.dtype,
                         (token_end - token_start, kv.num_kv_heads, kv.head_dim), region, offset, data.nbytes,
                         checksum(data))


def into_slots(request_id: str, arena: ArenaLayout, region: int, layer: int, keys: torch.Tensor, values: torch.Tensor,
               slots: Sequence[int], first_token: int) -> Iterator[tuple[KvChunkHeader, memoryview]]:
    """Chunks writing ``keys`` and ``values`` (token-major, contiguous) of tokens ``first_token ..``
    into ``slots`` (block-aligned: ``slots[0]`` holds the block starting at ``first_token``)."""
    n = keys.shape[0]
    for kind, tensor in ((KEYS, keys), (VALUES, values)):
        for run in runs(list(slots), first_token, first_token + n, arena.block_tokens):
            data = byte_view(tensor[run.token_start - first_token : run.token_end - first_token])
            yield (header(request_id, layer, kind, run.token_start, run.token_end, arena.kv, region,
                          arena.offset(layer, kind, run.slot), data), data)


def from_slots(request_id: str, arena: ArenaLayout, memory: memoryview, layer: int, slots: Sequence[int],
               num_tokens: int, buffer_tokens: int, region: int) -> Iterator[tuple[KvChunkHeader, memoryview]]:
    """Chunks sending tokens ``0 .. num_tokens`` of ``layer`` held by ``slots`` (``memory``: the
    arena's bytes) into a request buffer of ``buffer_tokens`` tokens, region ``region``."""
    kv = arena.kv
    for kind in (KEYS, VALUES):
        for run in runs(list(slots), 0, num_tokens, arena.block_tokens):
            start = arena.offset(layer, kind, run.slot)
            data = memory[start : start + (run.token_end - run.token_start) * kv.token_bytes]
            yield (header(request_id, layer, kind, run.token_start, run.token_end, kv, region,
                          kv.offset(buffer_tokens, layer, kind, run.token_start), data), data)


def tokens_of_run(header: KvChunkHeader) -> int:
    return header.token_end - header.token_start
