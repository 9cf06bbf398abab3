"""Continuous batching: sequences join and leave a running batch between decode steps.

All sequences of the batch share one key buffer and one value buffer per layer, shaped
``(rows, kv_heads, capacity, head_dim)``; row *i* holds sequence *i*'s tokens at positions
``0 .. length-1``. A step feeds each row its last sampled token at its own position (so rotary
embeddings are right), writes the new keys and values at ``length``, and attends over
``0 .. max(length)`` with an additive mask that hides each row's unused tail. Rows are kept
dense: a leaving sequence's row is filled with the last row.

Growing the buffers stalls every sequence of the batch, so it is made rare and cheap: a joining
sequence reserves room for its whole output (prompt + ``max_tokens``, within the model's
context; at most 1024 output tokens ahead), so steps rarely grow them; the buffers are allocated
uninitialised, on the CPU with a row for every sequence the batch may hold (the memory is mapped
lazily: capacity no row reached costs nothing; on a GPU, where it is not, rows double as
needed), and only what is in use is copied. A masked position
must still hold a finite number (0 × NaN is NaN), so every row in use is kept finite below
``_clean``, a high-water mark that each step and each join extend with zeros.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from pdflow import kernels
from pdflow.engine.loader import LoadedModel
from pdflow.engine.sampler import Sampler, sample_batch
from pdflow.kv.layout import torch_dtype

_CAPACITY_STEP = 256
_RESERVE_MAX = 1024  # output tokens a joining sequence reserves room for, at most


@dataclass(slots=True)
class Acceptance:
    """How a sequence's drafts fared (speculative decoding, which alone reads and updates it):
    decaying counts of draft tokens kept and of verifies that rejected one, and the steps it has
    drafted nothing since its last probe."""

    kept: float = 0.0
    missed: float = 0.0
    idle: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """One request in decode. ``length`` tokens are cached; ``next_token`` is fed next, at
    position ``length + skipped``: ``skipped`` prompt tokens' KV was dropped (a sink + window
    codec), and what is cached keeps its own positions.

    ``context`` is the stage's own record of the request (decode's, the colocated worker's), for
    the stage to read back when the batch hands it the sequence; the engine never looks at it."""

    request_id: str
    length: int
    next_token: int
    sampler: Sampler
    generated: int = 1  # the first token came from prefill
    finish_reason: str | None = None
    skipped: int = 0
    history: list[int] | None = None  # the prompt's tokens and every one since (next_token last), if kept
    proposed: int = 0  # speculative decoding: draft tokens verified for it ...
    accepted: int = 0  # ... and kept
    acceptance: Acceptance = field(default_factory=Acceptance)
    steps: list[float] = field(default_factory=list)  # when each decode step gave it tokens (its timeline)
    context: Any = None

    @property
    def position(self) -> int:
        """The position of ``next_token``."""
        return self.length + self.skipped


class _BatchCache:
    """The cache object the layers see during one step."""

    def __init__(self, batch: "DecodeBatch", rows: torch.Tensor, positions: torch.Tensor, kv_len: int,
                 gather: bool = False):
        """Input row *r* is the token at place ``positions[r]`` of batch row ``rows[r]``;
        ``gather``: rows are not simply ``0 .. n-1`` (several places of one sequence)."""
        self.batch, self.rows, self.positions, self.kv_len, self.gather = batch, rows, positions, kv_len, gather

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_):
        n = self.rows.shape[0]
        keys, values = self.batch.keys[layer_idx], self.batch.values[layer_idx]
        keys[self.rows, :, self.positions] = key_states[:, :, 0]
        values[self.rows, :, self.positions] = value_states[:, :, 0]
        pruned = self.batch.pruned_heads(layer_idx)
        if pruned is not None:  # zero values: the pruned heads' query heads put out exactly zero
            keys[self.rows[:, None], pruned[None, :], self.positions[:, None]] = 0
            values[self.rows[:, None], pruned[None, :], self.positions[:, None]] = 0
        if self.gather:
            return keys[self.rows, :, : self.kv_len], values[self.rows, :, : self.kv_len]
        return keys[:n, :, : self.kv_len], values[:n, :, : self.kv_len]


class _KernelBatchCache(_BatchCache):
    """Also ``attend``: write the step's keys and values, then attend with pdflow's decode-attention
    kernel straight from the batch buffers, each row over its own positions only (no mask, no
    slice, nothing read past a row's end); and ``blocks()``, the same addressing for a step run
    wholly in C (:meth:`CompactLlama.forward`)."""

    def __init__(self, batch: "DecodeBatch", rows: torch.Tensor, positions: torch.Tensor, kv_len: int, lib):
        super().__init__(batch, rows, positions, kv_len)
        self.lib = lib
        self.lengths = (positions + 1).contiguous()
        self.table = rows[:, None].contiguous()  # one slot (the row) per sequence

    def blocks(self) -> kernels.CacheBlocks:
        keys, values = self.batch.keys, self.batch.values
        _, kv_heads, capacity, head_dim = keys[0].shape
        pointers = ctypes.c_void_p * len(keys)
        return kernels.CacheBlocks(self.lengths, self.table, 1, capacity, pointers(*(k.data_ptr() for k in keys)),
                                   pointers(*(v.data_ptr() for v in values)), kv_heads * capacity * head_dim,
                                   head_dim, capacity * head_dim, self.batch.kv_keep)

    def attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               scale: float) -> torch.Tensor:
        """``query`` ``(batch, heads, head_dim)`` contiguous, the step's ``key_states`` and
        ``value_states`` ``(batch, kv_heads, 1, head_dim)`` (each head's vector contiguous) ->
        attention output like ``query``. The kernel writes the new keys and values first."""
        keys, values = self.batch.keys[layer_idx], self.batch.values[layer_idx]
        batch, heads, head_dim = query.shape
        _, kv_heads, capacity, _ = keys.shape
        if key_states.stride(-1) != 1 or value_states.stride(-1) != 1 or key_states.stride(1) != head_dim \
                or value_states.stride(1) != head_dim:
            key_states, value_states = key_states.contiguous(), value_states.contiguous()
        out = torch.empty_like(query)
        self.lib.pdflow_decode_attention(
            query.data_ptr(), batch, heads, kv_heads, head_dim, self.lengths.data_ptr(), self.table.data_ptr(), 1,
            capacity, keys.data_ptr(), values.data_ptr(), kv_heads * capacity * head_dim, head_dim,
            capacity * head_dim, key_states.data_ptr(), value_states.data_ptr(), key_states.stride(0),
            value_states.stride(0), scale,
            None if self.batch.kv_keep is None else self.batch.kv_keep[layer_idx].data_ptr(), out.data_ptr(),
            torch.get_num_threads())
        return out


class DecodeBatch:
    def __init__(self, loaded: LoadedModel, max_batch: int, attention_kernel: bool | None = None):
        """``attention_kernel``: attend with pdflow's kernel (None: wherever it runs, i.e. the
        compact engine in fp32 on the CPU with the kernels built) or with PyTorch's
        ``scaled_dot_product_attention`` and a mask."""
        self.loaded = loaded
        self.max_batch = max_batch
        fused = getattr(loaded.model, "fused", None)
        usable = fused is not None and loaded.layout.dtype == "float32"
        if attention_kernel and not usable:
            raise ValueError("the attention kernel needs the compact engine in float32 on the CPU with pdflow's kernels")
        self._kernel_lib = fused.lib if usable and attention_kernel is not False else None
        self.sequences: list[Sequence] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows_cap = 0
        self._len_cap = 0
        self._clean = 0  # rows in use hold finite values (KV or zeros) at positions below this
        self.kv_keep: torch.Tensor | None = None  # uint8 (layers, kv_heads): 0 where a kv head is pruned
        self.speculation = None  # a pdflow.speculative.Speculation: steps draft and verify

    def pruned_heads(self, layer: int) -> torch.Tensor | None:
        """The kv heads of ``layer`` that are pruned (None: none)."""
        if self.kv_keep is None or bool(self.kv_keep[layer].all()):
            return None
        return (self.kv_keep[layer] == 0).nonzero()[:, 0].to(self.loaded.device)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def full(self) -> bool:
        return len(self.sequences) >= self.max_batch

    def _ensure_capacity(self, rows: int, length: int) -> None:
        if rows <= self._rows_cap and length <= self._len_cap:
            return
        dtype, device = torch_dtype(self.loaded.layout.dtype), self.loaded.device
        if rows <= self._rows_cap:
            new_rows = self._rows_cap
        elif torch.device(device).type == "cpu":  # lazily mapped: rows no sequence uses cost nothing
            new_rows = self.max_batch
        else:  # device memory is reserved whole: grow by doubling
            new_rows = min(self.max_batch, max(rows, 2 * self._rows_cap, 4))
        new_len = max(self._len_cap, -(-length // _CAPACITY_STEP) * _CAPACITY_STEP)
        layout = self.loaded.layout
        shape = (new_rows, layout.num_kv_heads, new_len, layout.head_dim)
        used, clean = len(self.sequences), self._clean
        for buffers in (self.keys, self.values):
            for layer in range(layout.num_layers):
                fresh = torch.empty(shape, dtype=dtype, device=device)
                if layer < len(buffers):
                    fresh[:used, :, :clean] = buffers[layer][:used, :, :clean]
                    buffers[layer] = fresh
                else:
                    buffers.append(fresh)
        self._rows_cap, self._len_cap = new_rows, new_len

    def _clean_to(self, rows: int, length: int) -> None:
        """Zero positions ``_clean .. length`` of the first ``rows`` rows and raise ``_clean``
        (the attention kernel reads no row past its end: it needs only the mark, which growth
        copies up to)."""
        if length > self._clean:
            if self._kernel_lib is None:
                for buf in (*self.keys, *self.values):
                    buf[:rows, :, self._clean : length] = 0
            self._clean = length

    # every method that touches the buffers runs in inference mode: buffers made during a step are
    # inference tensors, which may only be written to in inference mode
    @torch.inference_mode()
    def add(self, seq: Sequence, layer_kv) -> None:
        """Join the batch. ``layer_kv(layer)`` gives that layer's ``(keys, values)``, each shaped
        ``(kv_heads, tokens, head_dim)`` (views are fine: they are copied into the row)."""
        if self.full:
            raise RuntimeError("decode batch is full")
        row = len(self.sequences)
        output_left = min(max(seq.sampler.params.max_tokens - seq.generated, 0), _RESERVE_MAX)
        final = min(seq.length + output_left, self.loaded.max_context)
        self._ensure_capacity(row + 1, max(final, seq.length) + 1)
        self._clean_to(row, seq.length)  # the rows already in: finite up to where this one's KV ends
        for layer in range(self.loaded.layout.num_layers):
            keys, values = layer_kv(layer)
            self.keys[layer][row, :, : seq.length] = keys
            self.values[layer][row, :, : seq.length] = values
            self.keys[layer][row, :, seq.length : self._clean] = 0
            self.values[layer][row, :, seq.length : self._clean] = 0
        self.sequences.append(seq)

    @torch.inference_mode()
    def export(self, seq: Sequence, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of ``seq``'s keys and values of tokens ``start .. end``: per layer, token-major."""
        row = self.sequences.index(seq)
        keys = [k[row, :, start:end].transpose(0, 1).contiguous() for k in self.keys]
        values = [v[row, :, start:end].transpose(0, 1).contiguous() for v in self.values]
        return keys, values

    @torch.inference_mode()
    def remove(self, seq: Sequence) -> None:
        row = self.sequences.index(seq)
        last = len(self.sequences) - 1
        if row != last:
            moved = self.sequences[last]
            for buffers in (self.keys, self.values):
                for buf in buffers:
                    buf[row, :, : moved.length] = buf[last, :, : moved.length]
            self.sequences[row] = moved
        self.sequences.pop()
        if self.speculation is not None:
            self.speculation.forget(seq)
        if not self.sequences:  # give the memory back when idle
            self.keys, self.values, self._rows_cap, self._len_cap, self._clean = [], [], 0, 0, 0

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, int]]:
        """Advance every sequence by one token (or, speculating, by the draft tokens it keeps and
        one more); returns ``(sequence, new_token)`` pairs, a sequence's in order."""
        seqs = self.sequences
        if not seqs:
            return []
        if self.speculation is not None:
            return self.speculation.step(self, seqs, self._forward_rows, self.loaded.max_context)
        n = len(seqs)
        logits = self._forward_rows(list(range(n)), [0] * n, [s.next_token for s in seqs])
        return advance(seqs, sample_batch(logits, [s.sampler for s in seqs]))

    def _forward_rows(self, owners: list[int], offsets: list[int], tokens: list[int],
                      num_layers: int | None = None) -> torch.Tensor:
        """Logits of rows of the batch's sequences, each one token (``tokens[r]``, of sequence
        ``owners[r]``, ``offsets[r]`` places after its ``next_token``), in one forward pass: a
        row's keys and values are written at its place, and it attends up to and including it.
        ``num_layers``: the first layers only (an early exit; the compact engine's)."""
        seqs, device = self.sequences, self.loaded.device
        places = torch.tensor([seqs[o].length + off for o, off in zip(owners, offsets)], device=device)
        kv_len = int(places.max()) + 1
        self._ensure_capacity(len(seqs), kv_len)
        self._clean_to(len(seqs), kv_len)
        rows = torch.tensor(owners, device=device)
        gather = owners != list(range(len(seqs)))
        input_ids = torch.tensor([[t] for t in tokens], device=device)
        mask = None
        if self._kernel_lib is not None:
            cache = _KernelBatchCache(self, rows, places, kv_len, self._kernel_lib)
        else:
            if len(owners) > 1 or kv_len != int(places[0]) + 1:
                visible = torch.arange(kv_len, device=device)[None, :] <= places[:, None]
                mask = torch.zeros(visible.shape, dtype=torch_dtype(self.loaded.layout.dtype), device=device)
                mask.masked_fill_(~visible, torch.finfo(mask.dtype).min)
                mask = mask[:, None, None, :]
            cache = _BatchCache(self, rows, places, kv_len, gather)
        positions = torch.tensor([[seqs[o].position + off] for o, off in zip(owners, offsets)], device=device)
        if num_layers is not None:
            return self.loaded.model(input_ids, positions, mask, cache, num_layers=num_layers)
        return self.loaded.model(input_ids, positions, mask, cache)


def advance(seqs: list[Sequence], tokens: list[int]) -> list[tuple[Sequence, int]]:
    """After a step: each sequence cached one more token and feeds its new one next."""
    for seq, token in zip(seqs, tokens):
        seq.length += 1
        seq.next_token = token
        seq.generated += 1
        if seq.history is not None:
            seq.history.append(token)
    return list(zip(seqs, tokens))
