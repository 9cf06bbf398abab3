"""Prefix caching inside one process: the colocated worker's own store.

The same :class:`~pdflow.kv.store.KvStore` as kv-shuttle's, used by copies instead of transfers:
a prompt's cached prefix is read out as past KV for its prefill, and the prompt's (and later its
answer's) full blocks are copied in. So disaggregated and colocated serving reuse the same
prefixes and stay a fair comparison.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdflow.kv.blocks import BlockHasher, reusable_blocks
from pdflow.kv.layout import KvLayout
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.store import KvStore, StoreFull

__all__ = ["LocalPrefixCache"]


class LocalPrefixCache:
    """A store and its hasher, safe to call from the thread that runs the model while another
    thread reads :meth:`stats`."""

    def __init__(self, kv: KvLayout, hasher: BlockHasher, capacity_bytes: int, **store_options) -> None:
        self.hasher = hasher
        self.block_tokens = hasher.block_tokens
        self.store = KvStore(kv, hasher.block_tokens, capacity_bytes, **store_options)
        self._lock = threading.Lock()

    def prefix(self, request_id: str, prompt_ids: list[int]
               ) -> tuple[int, tuple[list[torch.Tensor], list[torch.Tensor]] | None]:
        """How many leading tokens of the prompt are cached (whole blocks, leaving at least one to
        compute), and their KV (per layer keys and values, token-major copies), or ``(0, None)``."""
        ids, owner = self.hasher.ids(prompt_ids), LeaseOwner(request_id)
        with self._lock:
            lease = self.store.lease(owner, ids, write=False, prompt_tokens=len(prompt_ids),
                                     max_hit=reusable_blocks(len(ids), len(prompt_ids), self.block_tokens))
            try:
                if not lease.hit:
                    return 0, None
                tokens = lease.hit * self.block_tokens
                return tokens, self.store.read(lease.slots[: lease.hit], tokens)
            finally:
                self.store.release(owner)

    def keep(self, token_ids: list[int], first_block: int, keys: Sequence[torch.Tensor],
             values: Sequence[torch.Tensor], keep_s: float | None = None) -> int:
        """Store the full blocks of ``token_ids`` from block ``first_block`` on, whose KV is given
        (per layer, token-major, from token ``first_block * block_tokens``); blocks already stored
        are skipped. Returns how many were added (0 when the store is full of leased blocks or
        the blocks before ``first_block`` are gone). ``keep_s``: how long (0: not at all)."""
        ids = self.hasher.ids(token_ids)
        if len(ids) <= first_block or keep_s == 0:
            return 0
        owner = LeaseOwner(f"keep:{id(keys)}", LeaseKind.WRITE)
        bt = self.block_tokens
        with self._lock:
            try:
                lease = self.store.lease(owner, ids, verify=False, count=False, keep_s=keep_s)
            except StoreFull:
                return 0
            try:
                if lease.hit < first_block:
                    return 0
                skip = (lease.hit - first_block) * bt
                self.store.write(lease.new_slots, lease.hit * bt, [k[skip:] for k in keys], [v[skip:] for v in values])
                return sum(self.store.commit(lease, i) for i in range(lease.hit, len(ids)))
            finally:
                self.store.release(owner)

    def forget(self, token_ids: list[int] | None) -> int:
        """Drop the KV of a prefix of ``token_ids`` and all built on it (None: everything); how many blocks."""
        ids = None if token_ids is None else self.hasher.ids(token_ids)
        if ids == []:
            return 0
        with self._lock:
            return self.store.forget(ids)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.store.stats().as_dict()
