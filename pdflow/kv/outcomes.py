"""What a read of a stored block can come to, in every tier: the block, or one of three reasons it
is not there. Each of the three means "recompute", never a failed request.

- ``MISS``: no such block (never stored, evicted, forgotten, expired);
- ``VERSION_MISMATCH``: the block is there, but not the version the reader recorded: it was replaced;
- ``CORRUPTED``: it was there and failed its checksum: dropped, never served.

:class:`~pdflow.kv.disk.DiskTier` answers with an :class:`Outcome`; the memory store's plain API
(:meth:`KvStore.get <pdflow.kv.store.KvStore.get>`) raises the matching :class:`BlockUnavailable`.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["BlockUnavailable", "Corrupted", "Miss", "Outcome", "VersionMismatch"]


class Outcome(Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPTED = "corrupted"
    VERSION_MISMATCH = "version_mismatch"


class BlockUnavailable(LookupError):
    """A block a reader asked for cannot be served; ``outcome`` says why."""

    outcome: Outcome

    def __init__(self, block_id: int, detail: str = "") -> None:
        self.block_id = block_id
        super().__init__(f"block {block_id:032x}: {self.outcome.value}{': ' + detail if detail else ''}")


class Miss(BlockUnavailable):
    outcome = Outcome.MISS


class VersionMismatch(BlockUnavailable):
    outcome = Outcome.VERSION_MISMATCH


class Corrupted(BlockUnavailable):
    outcome = Outcome.CORRUPTED
