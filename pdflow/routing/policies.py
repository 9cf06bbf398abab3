"""The built-in routing policies."""

from __future__ import annotations

import random

from pdflow.routing.base import ReplicaStatus, Router, RoutingRequest


class RoundRobinRouter(Router):
    """Each stage's healthy replicas in turn (a replica that is down is skipped)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        turn = self._next.get(stage, 0)
        self._next[stage] = turn + 1
        return replicas[turn % len(replicas)].replica


class LeastLoadedRouter(Router):
    """The replica with the least load (ties: the lowest number)."""

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        return min(replicas, key=lambda r: (r.load, r.replica)).replica


class PowerOfTwoRouter(Router):
    """Two replicas at random, the less loaded of them: nearly least-loaded's balance without
    every ingress herding onto the same replica (Mitzenmacher's power of two choices)."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        if len(replicas) == 1:
            return replicas[0].replica
        a, b = self._random.sample(replicas, 2)
        return min((a, b), key=lambda r: (r.load, r.replica)).replica


class CacheAwareRouter(Router):
    """Where the KV already is (Mooncake's Conductor, in small): for the stage that keeps KV
    (kv-shuttle), the replica with the least estimated time to first token, ``in flight x
    queue_s`` plus the prefill of the prompt's tokens it does not hold at ``prefill_tokens_per_s``
    (a prefix it holds is read, not recomputed); for every other stage (and where no store has
    reported yet), the least loaded. ``prefill_tokens_per_s``: this CPU's SmolLM2 prefill
    (docs/benchmarks.md); ``queue_s``: what one more request in flight there adds to a request's
    wait (kv-shuttle's own work per request is small: a lookup and a transfer)."""

    uses_holdings = True

    def __init__(self, prefill_tokens_per_s: float = 400.0, queue_s: float = 0.05) -> None:
        for name, value in (("prefill_tokens_per_s", prefill_tokens_per_s), ("queue_s", queue_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ValueError(f"cache_aware router: {name} must be a number >= 0, got {value!r}")
        if prefill_tokens_per_s == 0:
            raise ValueError("cache_aware router: prefill_tokens_per_s must be > 0")
        self.rate, self.queue_s = float(prefill_tokens_per_s), float(queue_s)

    def estimate_s(self, request: RoutingRequest, replica: ReplicaStatus) -> float:
        """Seconds to the first token through ``replica``, as far as the choice of it changes them."""
        uncached = max(0, len(request.prompt_ids) - (replica.cached_tokens or 0))
        return replica.load * self.queue_s + uncached / self.rate

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        if all(r.cached_tokens is None for r in replicas):
            return min(replicas, key=lambda r: (r.load, r.replica)).replica
        return min(replicas, key=lambda r: (self.estimate_s(request, r), r.load, r.replica)).replica
