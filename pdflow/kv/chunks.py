"""KV chunks between the store's slots and request buffers: which bytes, with which header.

A chunk is the keys (or values) of one layer over a run of tokens: from a tensor into a run of
consecutive slots of the arena (prefill writing a prompt's new blocks, decode writing an answer's
blocks), or from a run of slots into a request buffer (the store sending a cached prefix). Headers
carry the real token range, so a receiver counts what has landed by tokens.

Into an encoded arena (the store's memory tier with a codec) a chunk travels as its run's
encoding, computed here, and lands as it is; out of one it travels as the encoding its slots
hold, and the receiver decodes it where it lands (:mod:`pdflow.kv.coded`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pdflow.kv.arena import ArenaLayout, runs
from pdflow.transports.checksum import checksum
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.messages import KvChunkHeader
from pdflow.transports.regions import byte_view

__all__ = ["between_slots", "from_slots", "header", "into_slots", "slot_of", "tokens_of_run"]


def header(request_id: str, layer: int, kind: int, token_start: int, token_end: int, kv: KvLayout, region: int,
           offset: int, data: memoryview, arena: ArenaLayout | None = None) -> KvChunkHeader:
    """The header of ``data``: the KV's own bytes, or (``arena`` encoded) its encoding in ``arena``'s codec."""
    coded = arena is not None and arena.encoded
    return KvChunkHeader(request_id, layer, kind, token_start, token_end, kv.dtype,
                         (token_end - token_start, kv.num_kv_heads, kv.head_dim), region, offset, data.nbytes,
                         checksum(data), arena.codec.spec if coded else "none", arena.block_tokens if coded else 0)


def into_slots(request_id: str, arena: ArenaLayout, region: int, layer: int, keys: torch.Tensor, values: torch.Tensor,
               slots: Sequence[int], first_token: int) -> Iterator[tuple[KvChunkHeader, memoryview]]:
    """Chunks writing ``keys`` and ``values`` (token-major, contiguous) of tokens ``first_token ..``
    into ``slots`` (block-aligned: ``slots[0]`` holds the block starting at ``first_token``)."""
    n = keys.shape[0]
    for kind, tensor in ((KEYS, keys), (VALUES, values)):
        for run in runs(list(slots), first_token, first_token + n, arena.block_tokens):
            part = tensor[run.token_start - first_token : run.token_end - first_token]
            if arena.encoded:  # the store keeps it encoded: encode it here, it lands as it is
                part = arena.codec.encode_run(part.contiguous(), kind, arena.block_tokens)
            data = byte_view(part)
            yield (header(request_id, layer, kind, run.token_start, run.token_end, arena.kv, region,
                          arena.offset(layer, kind, run.slot), data, arena), data)


def from_slots(request_id: str, arena: ArenaLayout, memory: memoryview, layer: int, slots: Sequence[int],
               num_tokens: int, buffer_tokens: int, region: int) -> Iterator[tuple[KvChunkHeader, memoryview]]:
    """Chunks sending tokens ``0 .. num_tokens`` of ``layer`` held by ``slots`` (``memory``: the
    arena's bytes) into a request buffer of ``buffer_tokens`` tokens, region ``region``."""
    kv = arena.kv
    for kind in (KEYS, VALUES):
        for run in runs(list(slots), 0, num_tokens, arena.block_tokens):
            start = arena.offset(layer, kind, run.slot)
            data = memory[start : start + arena.run_bytes(kind, run.token_end - run.token_start)]
            yield (header(request_id, layer, kind, run.token_start, run.token_end, kv, region,
                          kv.offset(buffer_tokens, layer, kind, run.token_start), data, arena), data)


def between_slots(request_id: str, src: ArenaLayout, memory: memoryview, layer: int, kinds: Sequence[int],
                  src_slots: Sequence[int], first_token: int, end_token: int, dst: ArenaLayout,
                  dst_slots: Sequence[int], region: int) -> Iterator[tuple[KvChunkHeader, memoryview]]:
    """Chunks copying tokens ``first_token .. end_token`` of ``layer`` (``kinds``: keys and/or
    values) from slots of ``src`` (``memory``: its bytes; ``src_slots[i]`` holds the block that
    starts at ``first_token + i * block_tokens``; ``first_token`` block-aligned) into slots of
    ``dst``, region ``region`` (``dst_slots[j]``: block *j* of the request; negative: a block the
    receiver does not want, which is skipped): one chunk per run of blocks whose slots are
    consecutive on both sides. Into an encoded ``dst`` only whole blocks of a ``src`` encoded
    alike (another store's arena) go, as their encodings."""
    bt, kv = src.block_tokens, src.kv
    if dst.encoded and not (src.encoded and src.codec.spec == dst.codec.spec and end_token % bt == 0):
        raise ValueError("chunks between slots go into an arena that keeps the KV's own bytes, or whole blocks "
                         "into one that keeps them in the same encoding")
    if dst.block_tokens != bt:
        raise ValueError(f"blocks of {bt} tokens cannot go into blocks of {dst.block_tokens}")
    first_block = first_token // bt
    blocks = -(-end_token // bt) - first_block
    if first_block + blocks > len(dst_slots) or blocks > len(src_slots):
        raise ValueError(f"tokens {first_token}..{end_token} do not fit the slots given")
    i = 0
    while i < blocks:
        if dst_slots[first_block + i] < 0:
            i += 1
            continue
        j = i + 1
        while j < blocks and src_slots[j] == src_slots[j - 1] + 1 \
                and dst_slots[first_block + j] == dst_slots[first_block + j - 1] + 1:
            j += 1
        start, end = first_token + i * bt, min(first_token + j * bt, end_token)
        for kind in kinds:
            at = src.offset(layer, kind, src_slots[i])
            data = memory[at : at + src.run_bytes(kind, end - start)]
            yield (header(request_id, layer, kind, start, end, kv, region,
                          dst.offset(layer, kind, dst_slots[first_block + i]), data, src), data)
        i = j


def slot_of(arena: ArenaLayout, header: KvChunkHeader) -> int:
    """The slot where a chunk written into ``arena`` starts."""
    return (header.offset - arena.offset(header.layer, header.kind, 0)) // arena.span(header.kind)


def tokens_of_run(header: KvChunkHeader) -> int:
    return header.token_end - header.token_start
