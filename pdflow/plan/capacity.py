"""How big a KV store a trace needs: its prefix hit ratio as a function of the store's capacity,
under LRU, from one pass over the trace.

A Mooncake-format trace (Mooncake's own: :mod:`pdflow.bench.traces` says where to get them) names each prompt's blocks (``hash_ids``, one per ``block_tokens`` tokens;
equal ids are equal prefixes). Every request touches all of its blocks in order: the ones the store
has are read (and become the most recently used), the rest are computed and stored. Which blocks
a request touches does not depend on what the store holds, so one pass computes each touch's *LRU
stack distance* (how many other blocks were touched since this block was last touched: it is in
an LRU store of ``C`` blocks exactly when that is below ``C``; Mattson et al., 1970), for every
capacity at once.

A request reuses only the leading run of its blocks that the store holds (a prefix: the KV of a
block depends on every token before it), so block ``k`` of a request counts as a hit at capacity
``C`` only if blocks ``1..k`` all are: its *effective* distance is the largest distance among them.
Hits are weighted by tokens (the last block of a prompt may be partial), so the ratio is the share
of prompt tokens that need no prefill. Capacity here is blocks of the store; bytes are blocks
times ``block_tokens`` times the model's KV bytes per token (:mod:`pdflow.plan.kv_bytes`).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdflow.bench import traces

__all__ = ["HitCurve", "hit_curve", "read_trace"]

TRACE_BLOCK_TOKENS = 512  # Mooncake's traces


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of a Mooncake-format JSONL trace, in arrival order; ValueError naming the line
    that is not JSON or lacks ``hash_ids`` / ``input_length``."""
    rows = []
    with open(traces.existing(path)) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            ids, length = row.get("hash_ids"), row.get("input_length")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{number}: hash_ids must be a list of integers")
            if not isinstance(length, int) or length < 0:
                raise ValueError(f"{path}:{number}: input_length must be an integer >= 0")
            rows.append(row)
    return sorted(rows, key=lambda r: r.get("timestamp", 0))  # stable: ties keep file order


@dataclass(frozen=True)
class HitCurve:
    """Prefix hit ratio (of prompt tokens) against capacity (blocks), for one trace."""

    requests: int
    prompt_tokens: int
    touches: int  # block touches, over every request
    distinct_blocks: int  # the working set: what a store that never evicts ends up holding
    block_tokens: int
    _distances: list[int]  # effective stack distances of the touches that can ever hit, sorted
    _cumulative: list[int]  # tokens of those touches, cumulative in that order

    @property
    def unbounded(self) -> float:
        """The hit ratio of a store that never evicts (capacity >= the working set)."""
        return self.at(self.distinct_blocks)

    def at(self, capacity_blocks: int) -> float:
        """The hit ratio of an LRU store of ``capacity_blocks`` blocks."""
        if self.prompt_tokens == 0 or capacity_blocks <= 0:
            return 0.0
        n = bisect.bisect_left(self._distances, capacity_blocks)  # distances < capacity: hits
        return (self._cumulative[n - 1] if n else 0) / self.prompt_tokens

    def blocks_for(self, share: float) -> int:
        """The fewest blocks at which the hit ratio reaches ``share`` of the unbounded one."""
        target = share * self.unbounded * self.prompt_tokens
        n = bisect.bisect_left(self._cumulative, math.ceil(target - 1e-9))
        return 0 if target <= 0 else self._distances[min(n, len(self._distances) - 1)] + 1

    def points(self, count: int = 16) -> list[tuple[int, float]]:
        """(capacity in blocks, hit ratio) at ``count`` capacities spaced evenly on a log scale
        from 1 block to the working set."""
        top = max(self.distinct_blocks, 1)
        caps = sorted({max(1, round(top ** (i / (count - 1)))) for i in range(count)}) if count > 1 else [top]
        return [(c, self.at(c)) for c in caps]


class _Fenwick:
    """Prefix sums over positions 0..n-1, point updates in O(log n)."""

    def __init__(self, n: int) -> None:
        self.tree = [0] * (n + 1)

    def add(self, i: int, delta: int) -> None:
        tree, i = self.tree, i + 1
        while i < len(tree):
            tree[i] += delta
            i += i & -i

    def before(self, i: int) -> int:
        """Sum over positions < i."""
        tree, total = self.tree, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


def hit_curve(rows: Iterable[dict], block_tokens: int = TRACE_BLOCK_TOKENS) -> HitCurve:
    """One pass over ``rows`` (in arrival order) -> the hit ratio at every capacity."""
    rows = list(rows)
    touches = sum(len(r["hash_ids"]) for r in rows)
    live = _Fenwick(touches)  # 1 at the position of each block's latest touch
    last: dict[int, int] = {}
    hits: list[tuple[int, int]] = []  # (effective distance, tokens) of touches that can ever hit
    prompt_tokens = t = 0
    for row in rows:
        ids, remaining = row["hash_ids"], row["input_length"]
        prompt_tokens += remaining
        effective = 0  # the largest distance so far in this prompt (-1: a block never seen before)
        for block in ids:
            tokens = min(block_tokens, max(remaining, 0))
            remaining -= block_tokens
            before = last.get(block)
            if before is None:
                effective = -1
            else:
                distance = live.before(t) - live.before(before + 1)  # blocks touched since, once each
                live.add(before, -1)
                if effective >= 0:
                    effective = max(effective, distance)
            live.add(t, 1)
            last[block] = t
            t += 1
            if effective >= 0 and tokens:
                hits.append((effective, tokens))
    hits.sort()
    cumulative, running = [], 0
    for _, tokens in hits:
        running += tokens
        cumulative.append(running)
    return HitCurve(len(rows), prompt_tokens, touches, len(last), block_tokens, [d for d, _ in hits], cumulative)
