"""Who holds a lease on the KV store's blocks: a request, and what of it the lease is for.

The store takes any hashable owner; pdflow's stages and tiers name theirs with
:class:`LeaseOwner`, so that what /health counts and what an expired lease ends are read by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LeaseKind", "LeaseOwner"]


class LeaseKind(Enum):
    REQUEST = "request"  # a request's prompt: its cached prefix, and slots for the blocks it computes
    ANSWER = "answer"  # slots for a finished request's answer, written back by decode
    FETCH = "fetch"  # a request's prefix on its way from another replica's store
    LOAD = "load"  # a request's prefix on its way from the disk tier
    SERVE = "serve"  # blocks read for another replica's fetch (request_id: that fetch's id)
    WRITE = "write"  # blocks written in one call (the store's put, the local cache's keep)


@dataclass(frozen=True, slots=True)
class LeaseOwner:
    request_id: str
    kind: LeaseKind = LeaseKind.REQUEST
