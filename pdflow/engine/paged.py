"""Continuous batching over paged KV: each sequence's keys and values stay in blocks of a pool,
where they landed, and a per-sequence block table says which.

The pool (:class:`KvPool`) is memory in the KV store's block layout (:mod:`pdflow.kv.arena`:
``(layers, 2, slots, block_tokens, kv_heads, head_dim)``, token-major within a slot), with a free
list. A sequence joins with the slots that already hold its prompt's KV (the data plane wrote it
there), so joining copies nothing; each step writes the new token's keys and values into the
sequence's last block (a fresh slot from the pool when the last one is full) and attends from the
blocks in place with pdflow's decode-attention kernel (or runs the whole step in C); leaving gives
the slots back, so nothing moves either. Compare :class:`pdflow.engine.decode.DecodeBatch`, which
copies each joining sequence into a dense row and moves rows when one leaves: it stays for what
the kernel does not run (other dtypes, GPUs, PyTorch attention).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from pdflow import kernels
from pdflow.engine.decode import Sequence, advance
from pdflow.engine.loader import LoadedModel
from pdflow.engine.sampler import sample_batch
from pdflow.kv.arena import ArenaLayout, anonymous_memory


class PoolExhausted(RuntimeError):
    """No free slot is left in the pool."""


class KvPool:
    """Slots of KV in the store's block layout, over ``memory`` (flat bytes; fresh lazily mapped
    memory if None: slots never touched cost nothing). ``owns_slots=False``: the memory is the KV
    store's arena, whose slots the store hands out (decode attending in the store): no free list."""

    def __init__(self, arena: ArenaLayout, memory: memoryview | None = None, owns_slots: bool = True):
        if arena.kv.dtype != "float32":
            raise ValueError(f"the paged decode batch attends with pdflow's float32 kernel, not {arena.kv.dtype}")
        self.arena = arena
        self.memory = memory if memory is not None else anonymous_memory(arena.nbytes)
        self.flat = torch.frombuffer(self.memory, dtype=torch.uint8, count=arena.nbytes)
        self.blocks = arena.view(self.flat)  # (layers, 2, slots, block_tokens, kv_heads, head_dim)
        self.owns_slots = owns_slots
        self._free = list(range(arena.num_slots - 1, -1, -1)) if owns_slots else []  # pop(): lowest first
        self._lock = threading.Lock()  # the stage's loop takes slots; its step thread gives them back
        layers = arena.kv.num_layers
        pointers = ctypes.c_void_p * layers
        self.key_pointers = pointers(*(self.blocks[layer, 0].data_ptr() for layer in range(layers)))
        self.value_pointers = pointers(*(self.blocks[layer, 1].data_ptr() for layer in range(layers)))

    @property
    def block_tokens(self) -> int:
        return self.arena.block_tokens

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slots_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def take(self, count: int) -> list[int]:
        with self._lock:
            if not self.owns_slots:
                raise PoolExhausted(f"{count} KV blocks wanted from the store's arena, which decode does not allocate")
            if count > len(self._free):
                raise PoolExhausted(f"{count} KV blocks wanted, {len(self._free)} free of {self.arena.num_slots}")
            return [self._free.pop() for _ in range(count)]

    def give(self, slots: list[int]) -> None:
        if not self.owns_slots:
            return  # the store's: it frees them when the request's lease ends
        with self._lock:
            self._free.extend(reversed(slots))

    def strides(self) -> tuple[int, int, int]:
        """Floats from one slot to the next, one token to the next, one kv head to the next."""
        kv = self.arena.kv
        return self.block_tokens * kv.num_kv_heads * kv.head_dim, kv.num_kv_heads * kv.head_dim, kv.head_dim

    def tokens(self, slots: list[int], start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the keys and values of tokens ``start .. end`` held by ``slots``: per layer,
        ``(tokens, kv_heads, head_dim)``."""
        bt = self.block_tokens
        first, last = start // bt, -(-end // bt)
        index = torch.tensor(slots[first:last])
        keys, values = [], []
        for layer in range(self.arena.kv.num_layers):
            for kind, out in ((0, keys), (1, values)):
                blocks = self.blocks[layer, kind].index_select(0, index)
                flat = blocks.reshape(-1, *blocks.shape[2:])
                out.append(flat[start - first * bt : end - first * bt].clone())
        return keys, values


class _PagedCache:
    """The cache object the layers see during one step: ``attend`` (layer by layer) and
    ``blocks()`` (the step wholly in C) both address the pool through the block table."""

    def __init__(self, pool: KvPool, lengths: torch.Tensor, table: torch.Tensor, lib, kv_keep: torch.Tensor | None):
        self.pool, self.lib, self.kv_keep = pool, lib, kv_keep
        self.lengths = lengths.contiguous()  # cached tokens, the step's own included
        self.table = table

    def update(self, *args, **kwargs):
        raise NotImplementedError("a paged batch attends in place (attend or blocks), never through update")

    def blocks(self) -> kernels.CacheBlocks:
        pool = self.pool
        return kernels.CacheBlocks(self.lengths, self.table, self.table.shape[1], pool.block_tokens,
                                   pool.key_pointers, pool.value_pointers, *pool.strides(), self.kv_keep)

    def attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               scale: float) -> torch.Tensor:
        pool = self.pool
        batch, heads, head_dim = query.shape
        kv_heads = pool.arena.kv.num_kv_heads
        if key_states.stride(-1) != 1 or value_states.stride(-1) != 1 or key_states.stride(1) != head_dim \
                or value_states.stride(1) != head_dim:
            key_states, value_states = key_states.contiguous(), value_states.contiguous()
        out = torch.empty_like(query)
        self.lib.pdflow_decode_attention(
            query.data_ptr(), batch, heads, kv_heads, head_dim, self.lengths.data_ptr(), self.table.data_ptr(),
            self.table.shape[1], pool.block_tokens, pool.key_pointers[layer_idx], pool.value_pointers[layer_idx],
            *pool.strides(), key_states.data_ptr(), value_states.data_ptr(), key_states.stride(0),
            value_states.stride(0), scale, None if self.kv_keep is None else self.kv_keep[layer_idx].data_ptr(),
            out.data_ptr(), torch.get_num_threads())
        return out


class PagedDecodeBatch:
    """A running batch whose KV stays in ``pool``'s blocks (see the module doc). The same
    interface as :class:`~pdflow.engine.decode.DecodeBatch`, except that ``add`` takes the slots
    holding the sequence's KV (the batch owns them from then on, and gives them back to the pool
    on ``remove``). ``pool`` may be None, or replaced, while the batch is empty."""

    def __init__(self, loaded: LoadedModel, max_batch: int, pool: KvPool | None):
        if not self.runs(loaded):
            raise ValueError("the paged decode batch needs the compact engine in float32 on the CPU with pdflow's "
                             "kernels")
        self.loaded, self.max_batch, self.pool = loaded, max_batch, pool
        self._lib = loaded.model.fused.lib
        self.kv_keep: torch.Tensor | None = None  # uint8 (layers, kv_heads): 0 where a kv head is pruned
        self.speculation = None  # a pdflow.speculative.Speculation: steps draft and verify
        self.sequences: list[Sequence] = []
        self.slots: list[list[int]] = []  # per sequence, its block table

    @staticmethod
    def runs(loaded: LoadedModel) -> bool:
        """Can a paged batch decode ``loaded`` (pdflow's kernels, float32, the CPU)?"""
        return (getattr(loaded.model, "fused", None) is not None and loaded.layout.dtype == "float32"
                and torch.device(loaded.device).type == "cpu")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def full(self) -> bool:
        return len(self.sequences) >= self.max_batch

    def add(self, seq: Sequence, slots: list[int]) -> None:
        """Join with ``slots``: block *i* of the sequence (tokens ``i * block_tokens`` on) is in
        slot ``slots[i]``; they hold its first ``seq.length`` tokens' KV."""
        if self.full:
            raise RuntimeError("decode batch is full")
        if len(slots) * self.pool.block_tokens < seq.length:
            raise ValueError(f"{len(slots)} blocks cannot hold {seq.length} tokens")
        self.sequences.append(seq)
        self.slots.append(list(slots))

    def add_from(self, seq: Sequence, layer_kv) -> None:
        """Join with KV that is not in the pool yet: ``layer_kv(layer)`` gives that layer's
        ``(keys, values)``, each ``(kv_heads, tokens, head_dim)``, copied into slots taken for the
        sequence's tokens and every token it may still generate (within the model's context)."""
        left = max(seq.sampler.params.max_tokens - seq.generated, 0)
        slots = self.pool.take(self.pool.slots_for(min(seq.length + left, self.loaded.max_context) + 1))
        bt = self.pool.block_tokens
        for layer in range(self.loaded.layout.num_layers):
            for kind, kv in enumerate(layer_kv(layer)):
                for i, slot in enumerate(slots[: self.pool.slots_for(seq.length)]):
                    part = kv[:, i * bt : (i + 1) * bt].transpose(0, 1)
                    self.pool.blocks[layer, kind, slot, : part.shape[0]] = part
        self.add(seq, slots)

    def remove(self, seq: Sequence) -> None:
        i = self.sequences.index(seq)
        self.sequences.pop(i)
        self.pool.give(self.slots.pop(i))
        if self.speculation is not None:
            self.speculation.forget(seq)

    def export(self, seq: Sequence, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of ``seq``'s keys and values of tokens ``start .. end``: per layer, token-major."""
        return self.pool.tokens(self.slots[self.sequences.index(seq)], start, end)

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, int]]:
        """Advance every sequence by one token; returns ``(sequence, new_token)`` pairs. A
        sequence whose next token starts a block takes a slot first (PoolExhausted if none is
        free: the caller reserves enough)."""
        seqs = self.sequences
        if not seqs:
            return []
        if self.speculation is not None:
            return self.speculation.step(self, seqs, self._forward_rows, self.loaded.max_context)
        bt = self.pool.block_tokens
        for seq, slots in zip(seqs, self.slots):
            if seq.length >= len(slots) * bt:
                slots += self.pool.take(1)
        width = max(len(s) for s in self.slots)
        table = torch.tensor([s + [0] * (width - len(s)) for s in self.slots], dtype=torch.int64)
        lengths = torch.tensor([s.length + 1 for s in seqs], dtype=torch.int64)
        positions = torch.tensor([s.length + s.skipped for s in seqs], dtype=torch.int64)
        input_ids = torch.tensor([[s.next_token] for s in seqs])
        cache = _PagedCache(self.pool, lengths, table, self._lib, self.kv_keep)
        logits = self.loaded.model(input_ids, positions[:, None], None, cache)
        return advance(seqs, sample_batch(logits, [s.sampler for s in seqs]))

    def _forward_rows(self, owners: list[int], offsets: list[int], tokens: list[int],
                      num_layers: int | None = None) -> torch.Tensor:
        """Logits of rows of the batch's sequences, each one token (``tokens[r]``, of sequence
        ``owners[r]``, ``offsets[r]`` places after its ``next_token``), in one forward pass: a
        row's keys and values are written at its place, and it attends over its sequence's cache
        up to and including its own place, so the rows of one sequence see each other causally.
        ``num_layers``: the first layers only (an early exit, see the model's forward)."""
        seqs, bt = self.sequences, self.pool.block_tokens
        furthest = {}
        for owner, offset in zip(owners, offsets):
            furthest[owner] = max(furthest.get(owner, 0), offset)
        for owner, offset in furthest.items():
            slots = self.slots[owner]
            while seqs[owner].length + offset >= len(slots) * bt:
                slots += self.pool.take(1)
        width = max(len(s) for s in self.slots)
        padded = [s + [0] * (width - len(s)) for s in self.slots]
        table = torch.tensor([padded[o] for o in owners], dtype=torch.int64)
        lengths = torch.tensor([seqs[o].length + off + 1 for o, off in zip(owners, offsets)], dtype=torch.int64)
        positions = torch.tensor([[seqs[o].position + off] for o, off in zip(owners, offsets)], dtype=torch.int64)
        cache = _PagedCache(self.pool, lengths, table, self._lib, self.kv_keep)
        return self.loaded.model(torch.tensor([[t] for t in tokens]), positions, None, cache, num_layers=num_layers)
