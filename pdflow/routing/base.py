"""The Router interface: ingress asks it, for each stage of a request's route, which replica.

A router sees the request (its id and prompt token ids) and every replica's live status: whether
it is healthy, the in-flight count from its latest heartbeat, how many of ingress's requests it
holds now (ingress counts those itself, so they are never stale) and, for a router that asks, how
much of the prompt's prefix a KV-keeping replica holds. Only healthy replicas are offered;
``pick`` returns one of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class NoReplicaAvailable(RuntimeError):
    """Every replica of the stage is down (ingress answers 503)."""


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    request_id: str
    prompt_ids: list[int]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    replica: int
    healthy: bool = True
    in_flight: int = 0  # from the replica's latest heartbeat (about a second old)
    assigned: int = 0  # ingress's requests on this replica now (exact)
    # tokens of the request's prompt, from its start, whose KV the replica holds or is computing
    # (a request routed there computes them now): for the stage that keeps KV (kv-shuttle), given
    # to a router that asks (``uses_holdings``); None: not known
    cached_tokens: int | None = None
    # of those, the ones its store has said it holds: what another replica could fetch from it now
    stored_tokens: int | None = None

    @property
    def load(self) -> int:
        return max(self.in_flight, self.assigned)


class Router(ABC):
    """Picks a replica of a stage for a request. Called on ingress's event loop: keep it quick.

    ``uses_holdings``: the stores publish which blocks they hold, and ingress fills
    :attr:`ReplicaStatus.cached_tokens` for the stage that keeps KV (a little work per request
    and a few messages a second per store, so only for a router that reads it)."""

    uses_holdings: bool = False

    @abstractmethod
    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        """The replica (its ``replica`` number) of ``stage`` that serves ``request``, one of
        ``replicas`` (never empty, all healthy)."""

    def fetch_from(self, stage: str, request: RoutingRequest, picked: int, replicas: list[ReplicaStatus]) -> int | None:
        """For the stage that keeps KV, once ``picked`` is chosen among ``replicas`` (the healthy
        ones): another replica it should fetch the prompt's prefix from, rather than compute what
        it lacks of it, or None (the default: never)."""
        return None

    def route(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        """What ingress calls: only the healthy replicas are offered to :meth:`pick`, and its
        answer is checked."""
        healthy = [r for r in replicas if r.healthy]
        if not healthy:
            raise NoReplicaAvailable(stage)
        picked = self.pick(stage, request, healthy)
        if picked not in {r.replica for r in healthy}:
            raise ValueError(f"{type(self).__name__} picked replica {picked!r} of {stage}, which is not one "
                             f"of the healthy replicas {[r.replica for r in healthy]}")
        return picked
