"""One table of requests per stage: the requests it holds, the messages that came too early, and
the ids that ended.

The control plane gives no order between senders: a stage may hear about a request from one peer
(kv-shuttle's KvDestination at prefill, prefill's PrefillDone at decode) before the message that
opens it (from ingress), and messages may arrive after the request ended (cancelled, stopped,
failed). So every stage keeps, in one place:

- ``active``: request id -> the stage's state for it, from ``open`` to ``end``;
- ``early``: messages for ids not yet opened, held until the request opens (then replayed),
  at most ``max_early`` messages in all and each until ``early_ttl_s`` has passed;
- ``ended``: ids that ended, remembered for ``ended_ttl_s`` (at most ``max_ended`` of them), so
  that a late message is dropped, not parked, and a late opening message does not reopen it.

:meth:`sizes` says how much each part holds; the leak tests check every part empty (``ended``
aside, which empties on its own) once the requests are over.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog

State = TypeVar("State")
log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class TableLimits:
    max_early: int = 10_000
    early_ttl_s: float = 300.0
    max_ended: int = 100_000
    ended_ttl_s: float = 600.0


class RequestTable(Generic[State]):
    def __init__(self, limits: TableLimits = TableLimits()):
        self.limits = limits
        self.active: dict[str, State] = {}
        self.early: OrderedDict[str, tuple[float, list[Any]]] = OrderedDict()  # id -> (deadline, messages)
        self.ended: OrderedDict[str, float] = OrderedDict()  # id -> when it may be forgotten
        self._early_count = 0

    # --- the life of a request ---------------------------------------------------------------

    def open(self, request_id: str, state: State) -> State:
        """Start holding ``request_id`` (ValueError if it is already held or has ended)."""
        if request_id in self.active or request_id in self.ended:
            raise ValueError(f"request {request_id} is already {'held' if request_id in self.active else 'over'}")
        self.active[request_id] = state
        return state

    def get(self, request_id: str) -> State | None:
        return self.active.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.active

    def __len__(self) -> int:
        return len(self.active)

    def end(self, request_id: str) -> State | None:
        """Forget ``request_id`` and remember that it ended; its state, if it was held."""
        state = self.active.pop(request_id, None)
        self.take_early(request_id)
        self.ended[request_id] = time.monotonic() + self.limits.ended_ttl_s
        self.ended.move_to_end(request_id)
        while len(self.ended) > self.limits.max_ended:
            self.ended.popitem(last=False)
        return state

    def is_over(self, request_id: str) -> bool:
        return request_id in self.ended

    # --- messages that come early ------------------------------------------------------------

    def hold(self, request_id: str, message: Any) -> None:
        """Keep ``message`` until ``request_id`` opens (or its deadline passes). When the bound is
        reached, the oldest waiting request's messages make room (logged)."""
        while self._early_count >= self.limits.max_early and self.early:
            oldest, (_, dropped) = self.early.popitem(last=False)
            self._early_count -= len(dropped)
            log.warning("request.early.dropped", request_id=oldest, messages=len(dropped),
                        reason=f"more than {self.limits.max_early} early messages held")
        entry = self.early.get(request_id)
        if entry is None:
            entry = self.early[request_id] = (time.monotonic() + self.limits.early_ttl_s, [])
        entry[1].append(message)
        self._early_count += 1

    def take_early(self, request_id: str) -> list[Any]:
        """The messages held for ``request_id``, in arrival order (and forget them)."""
        entry = self.early.pop(request_id, None)
        if entry is None:
            return []
        self._early_count -= len(entry[1])
        return entry[1]

    # --- housekeeping ------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> None:
        """Drop early messages past their deadline and forget ended ids past theirs."""
        now = time.monotonic() if now is None else now
        while self.early:  # oldest first: every hold has the same time to live
            request_id, (deadline, messages) = next(iter(self.early.items()))
            if deadline > now:
                break
            self.take_early(request_id)
            log.warning("request.early.expired", request_id=request_id, messages=len(messages),
                        message=type(messages[0]).__name__)
        while self.ended and next(iter(self.ended.values())) <= now:
            self.ended.popitem(last=False)

    def sizes(self) -> dict[str, int]:
        return {"active": len(self.active), "early": self._early_count, "ended": len(self.ended)}
