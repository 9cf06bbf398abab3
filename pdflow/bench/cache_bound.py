"""What an unbounded prefix cache could have served on the same request sequence.

A request's prompt can only hit blocks that some earlier request produces: the blocks of any
prompt sent before it (a store that waits for blocks an earlier prefill is computing serves them,
as pdflow's kv-shuttle does), and of an earlier prompt plus its answer once that answer had ended
(a chat's next turn re-sends both), all but the answer's last token (it is never fed back, so no
server has its KV). Replaying
the run's own send and reply times over the prompts' block ids gives the hits a cache that never
evicts would have had: the bound a measured hit ratio is compared with.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdflow.kv.blocks import BlockHasher, reusable_blocks

if TYPE_CHECKING:
    from pdflow.bench.serve_client import RequestRecord


def infinite_cache_hits(records: Sequence[RequestRecord], block_tokens: int) -> list[int] | None:
    """Per record, the prompt tokens an unbounded cache of ``block_tokens``-token blocks could
    have served (0 for failed requests); None when a prompt's token ids are unknown (text prompts)."""
    if any(r.prompt_ids is None for r in records):
        return None
    hasher = BlockHasher("bench", "", block_tokens)
    ready: list[tuple[float, int, list[int]]] = []  # (when, tie-break, token ids): available from then on
    seen: set[int] = set()
    hits = [0] * len(records)
    order = sorted(range(len(records)), key=lambda i: records[i].sent_s)
    for n, i in enumerate(order):
        record = records[i]
        while ready and ready[0][0] <= record.sent_s:
            seen.update(hasher.ids(heapq.heappop(ready)[2]))
        if not record.ok:
            continue
        ids = hasher.ids(record.prompt_ids)
        hit = next((k for k, block in enumerate(ids) if block not in seen), len(ids))
        hits[i] = reusable_blocks(hit, len(record.prompt_ids), block_tokens) * block_tokens
        seen.update(ids)
        if record.answer_ids:
            sequence = record.prompt_ids + record.answer_ids[:-1]
            heapq.heappush(ready, (record.sent_s + record.e2e_s, n, sequence))
    return hits
