"""The requests a simulation replays: a Mooncake-format trace (Mooncake's own:
:mod:`pdflow.bench.traces` says where to get them), or a synthetic Poisson workload."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdflow.plan.capacity import TRACE_BLOCK_TOKENS, read_trace

__all__ = ["SimRequest", "TracePrompt", "from_trace", "synthetic"]


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: list[int]
    # what happened to it (filled in by the simulation)
    cached_tokens: int = 0
    fetched_tokens: int = 0
    prefix_in_s: float = 0.0  # when its cached prefix is all at its prefill replica
    first_token_s: float | None = None
    kv_in_s: float | None = None  # when decode held all of its KV (disaggregated)
    done_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    route: tuple[int, int, int] = (0, 0, 0)  # prefill, store, decode replica


class TracePrompt(Sequence):
    """A prompt's token ids, made up from its block ids (a trace has no text): token ``i`` is
    ``hash_ids[i // block] * block + i % block``, so two prompts agree on a prefix exactly where
    their blocks do. Lazy: a router that only takes its length allocates nothing."""

    __slots__ = ("_ids", "_len", "_block")

    def __init__(self, hash_ids: list[int], length: int, block: int) -> None:
        self._ids, self._len, self._block = hash_ids, length, block

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        block = self._ids[i // self._block] if i // self._block < len(self._ids) else -1
        return block * self._block + i % self._block


def from_trace(path: str, limit: int | None = None, speed: float = 1.0, token_scale: float = 1.0,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> list[SimRequest]:
    """A Mooncake-format trace, replayed ``speed`` times as fast; ``token_scale`` shrinks every
    length (and so every block) by that factor, keeping which prompts share which blocks."""
    if speed <= 0 or token_scale <= 0:
        raise ValueError("speed and token_scale must be > 0")
    rows = read_trace(path, limit)
    if not rows:
        raise ValueError(f"{path}: no requests")
    start = rows[0].get("timestamp", 0)
    return [SimRequest(n, (row.get("timestamp", 0) - start) / 1000 / speed,
                       max(1, round(row["input_length"] * token_scale)),
                       max(1, round(row.get("output_length", 1) * token_scale)), list(row["hash_ids"]))
            for n, row in enumerate(rows)]


def synthetic(count: int, rate: float, input_len: int, output_len: int, shared_prefix: int = 0,
              block_tokens: int = TRACE_BLOCK_TOKENS, seed: int = 0) -> list[SimRequest]:
    """``count`` Poisson arrivals at ``rate`` a second, each ``input_len`` tokens in (the first
    ``shared_prefix`` of them the same for all) and ``output_len`` out."""
    if count < 1 or rate <= 0 or input_len < 1 or output_len < 1:
        raise ValueError("count, rate, input_len and output_len must be > 0")
    rng = random.Random(seed)
    shared = shared_prefix // block_tokens
    blocks = -(-input_len // block_tokens)
    requests, t = [], 0.0
    for n in range(count):
        t += rng.expovariate(rate)
        ids = list(range(shared)) + [10**9 + n * blocks + k for k in range(blocks - shared)]
        requests.append(SimRequest(n, t, input_len, output_len, ids))
    return requests
