"""Blocks on their way into the store: an earlier request's prefill is computing them, or decode
is writing an answer's back.

A request whose prefix goes on in such blocks can wait for them instead of computing them a
second time: with prefill working through its queue in order, the earlier request is computed
before this one anyway, and waiting costs nothing. But a prefill that has got to the later request
first (several prefill replicas, or a request re-sent after a failure) may have queued the earlier
one behind it: waiting would then hold prefill idle until the earlier request's deadline. So a
waiter gives up once prefill says it wants the waiter's plan (``PlanWanted``) while the earlier
request has not begun; one that has begun is being computed and will be stored. An answer's
blocks are computed already (they have begun); a writer's ``patience_s`` bounds how long anyone
waits for them (a decode that died never sends them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Writer:
    """Blocks one request writes into the store (prompt blocks the store lacked, or its answer's)."""

    arrival: int  # its place in the order requests arrived: only later ones wait for it (0: anyone)
    ids: list[int]
    stored: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    began: bool = False  # a chunk of it has landed: it is being computed (or was)
    patience_s: float | None = None  # waiting for it ends after this long (None: at the waiter's deadline)


class InFlight:
    """Which request is computing each block not stored yet, and waiting for them."""

    def __init__(self) -> None:
        self._writers: dict[int, Writer] = {}  # block id -> the first request that computes it
        self.waits = 0  # plans that waited for another request's blocks
        self.given_up = 0  # ... and went on without them

    def __len__(self) -> int:
        return len(self._writers)

    def add(self, arrival: int, ids: list[int], *, began: bool = False, patience_s: float | None = None) -> Writer:
        """A request (``arrival``-th to arrive; 0: any request may wait for it) writes blocks ``ids``."""
        writer = Writer(arrival, list(ids), began=began, patience_s=patience_s)
        for block_id in ids:
            self._writers.setdefault(block_id, writer)
        return writer

    def writer_of(self, block_id: int, arrival: int) -> Writer | None:
        """The request that arrived before the ``arrival``-th and is computing ``block_id``, if any."""
        writer = self._writers.get(block_id)
        return writer if writer is not None and writer.arrival < arrival else None

    def done(self, writer: Writer | None) -> None:
        """``writer``'s blocks are stored, or never will be (it ended): its waiters go on."""
        if writer is None or writer.stored.done():
            return
        for block_id in writer.ids:
            if self._writers.get(block_id) is writer:
                del self._writers[block_id]
        writer.stored.set_result(None)

    async def wait(self, writer: Writer, wanted: asyncio.Future, timeout_s: float) -> bool:
        """Wait until ``writer``'s blocks are stored: True. False (compute them yourself) once
        ``wanted`` is done (prefill waits for the waiter's plan) while ``writer`` has not begun,
        or after ``timeout_s`` (or the writer's ``patience_s``, if shorter)."""
        self.waits += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(timeout_s, writer.patience_s if writer.patience_s is not None else timeout_s)
        while not writer.stored.done():
            if (wanted.done() and not writer.began) or loop.time() >= deadline:
                self.given_up += 1
                return False
            pending = {writer.stored} if wanted.done() else {writer.stored, wanted}
            await asyncio.wait(pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
        return True
