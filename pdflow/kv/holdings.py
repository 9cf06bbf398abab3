"""Which blocks each KV store holds, as ingress knows it: what cache-aware routing reads.

A store keeps a :class:`Journal` of the block ids it indexed and dropped; kv-shuttle drains it a
few times a second into a :class:`~pdflow.messages.KvHoldings` to ingress (the changes, and every
so often all it holds, so a lost or late message is repaired). Ids travel as their low 64 bits, 8
bytes each: a summary whose false matches (two different 128-bit ids agreeing on 64) are as rare
as 2^-64 per pair, and which at most misroutes a request, never serves wrong KV (the store checks
full ids when the request arrives). :class:`Holdings` is ingress's side: per replica, the set it
was told, the blocks of the prompts it routed there and still runs (a store reports a prompt's
blocks once they are computed; the next turn of a conversation can come before that, and should
go where they are being computed), and how much of a prompt's prefix each holds.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

__all__ = ["Holdings", "Journal", "pack_ids", "short_id", "unpack_ids"]

_MASK = (1 << 64) - 1
MAX_IDS = 1 << 22  # ids in one message at most (32 MiB packed): more is a peer misbehaving


def short_id(block_id: int) -> int:
    """The 64 bits of a block id that travel."""
    return block_id & _MASK


def pack_ids(ids: Iterable[int]) -> bytes:
    packed = array("Q", (short_id(i) for i in ids))
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> array:
    """The ids :func:`pack_ids` packed; ValueError for bytes that are not a whole number of ids
    (or more than :data:`MAX_IDS`)."""
    if len(data) % 8 or len(data) > 8 * MAX_IDS:
        raise ValueError(f"{len(data)} bytes are not a list of at most {MAX_IDS} 8-byte block ids")
    ids = array("Q")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


class Journal:
    """The block ids a store indexed and dropped since the last :meth:`drain` (an id added then
    dropped in between is neither)."""

    __slots__ = ("added", "removed")

    def __init__(self) -> None:
        self.added: set[int] = set()
        self.removed: set[int] = set()

    def add(self, block_id: int) -> None:
        self.removed.discard(block_id)
        self.added.add(block_id)

    def remove(self, block_id: int) -> None:
        if block_id in self.added:
            self.added.discard(block_id)
        else:
            self.removed.add(block_id)

    def drain(self) -> tuple[set[int], set[int]]:
        changes = self.added, self.removed
        self.added, self.removed = set(), set()
        return changes


class Holdings:
    """Ingress's picture of what each replica of the KV-holding stages holds."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], set[int]] = {}
        self._seq: dict[tuple[str, int], int] = {}
        # blocks on their way into a store: the prompts of requests routed to it, until they end
        self._coming: dict[tuple[str, int], Counter[int]] = {}
        self._expected: dict[Hashable, tuple[tuple[str, int], list[int]]] = {}

    def expect(self, request: Hashable, stage: str, replica: int, ids: Sequence[int]) -> None:
        """``request``, routed to ``replica`` of ``stage``, will put blocks ``ids`` there (its
        prompt's): count them as held until :meth:`settle` (by then the store's report says)."""
        self.settle(request)
        key, shorts = (stage, replica), [short_id(i) for i in ids]
        self._coming.setdefault(key, Counter()).update(shorts)
        self._expected[request] = (key, shorts)

    def settle(self, request: Hashable) -> None:
        """``request`` ended (or was routed again): its blocks are the store's to report now."""
        found = self._expected.pop(request, None)
        if found is None:
            return
        key, shorts = found
        coming = self._coming[key]
        coming.subtract(shorts)
        for block_id in shorts:
            if coming[block_id] <= 0:
                del coming[block_id]

    def apply(self, stage: str, replica: int, seq: int, full: bool, added: bytes, removed: bytes) -> bool:
        """Take one report; False (and the replica's picture dropped until its next full report)
        when it does not follow the last one, or does not decode."""
        key = (stage, replica)
        try:
            new, gone = unpack_ids(added), unpack_ids(removed)
        except ValueError:
            self.forget(stage, replica)
            return False
        if full:
            self._held[key] = set(new)
        elif key not in self._held or seq != self._seq.get(key, -2) + 1:
            self.forget(stage, replica)  # a gap: wait for the next full report
            return False
        else:
            held = self._held[key]
            held.difference_update(gone)
            held.update(new)
        self._seq[key] = seq
        return True

    def forget(self, stage: str, replica: int) -> None:
        """Nothing is known of the replica (it died, or a report went missing)."""
        self._held.pop((stage, replica), None)
        self._seq.pop((stage, replica), None)

    def known(self, stage: str, replica: int) -> bool:
        return (stage, replica) in self._held

    def prefix_blocks(self, stage: str, replica: int, ids: Sequence[int], coming: bool = True) -> int:
        """How many of ``ids`` (a prompt's block ids, in order), from the first, the replica holds
        or (``coming``) will soon (a request routed there computes them now)."""
        held = self._held.get((stage, replica), ())
        coming = self._coming.get((stage, replica), {}) if coming else {}
        count = 0
        for block_id in ids:
            short = short_id(block_id)
            if short not in held and short not in coming:
                break
            count += 1
        return count
