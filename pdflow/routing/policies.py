"""The built-in routing policies."""

from __future__ import annotations

import random

from pdflow.routing.base import ReplicaStatus, Router, RoutingRequest


class RoundRobinRouter(Router):
    """Each stage's healthy replicas in turn (a replica that is down is skipped). The turn is kept
    per set of replicas offered: where ingress offers a subset (host locality: the prefills beside
    the store picked), each subset takes its replicas in turn, rather than one counter that the
    alternating subsets would alias onto the same replica."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, tuple[int, ...]], int] = {}

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        key = (stage, tuple(r.replica for r in replicas))
        turn = self._next.get(key, 0)
        self._next[key] = turn + 1
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
    queue_s`` plus the prefill of the prompt's tokens it cannot have from a store at
    ``prefill_tokens_per_s``, plus fetching the part of the prefix another replica has stored
    and it does not hold at ``fetch_tokens_per_s`` (a prefix held is read, not recomputed; blocks
    a replica is still computing count as its own, but cannot be fetched from it yet; 0: no
    fetching, only a replica's own prefix counts); for every other stage (and where no store has
    reported yet), the least loaded.

    ``prefill_tokens_per_s``: this CPU's SmolLM2 prefill (docs/benchmarks.md); ``queue_s``: what
    one more request in flight there adds to a request's wait (kv-shuttle's own work per request
    is small: a lookup and a transfer); ``fetch_tokens_per_s``: SmolLM2's KV (45 KiB a token in
    fp32) fetched between two stores over tcp on this machine, measured at 14,000-19,000 tokens/s
    for 1,024- to 4,096-token prefixes (docs/benchmarks.md, "Routing"). The replica picked
    fetches from the one that has stored the most of the prefix when that is more than it holds
    (:meth:`fetch_from`) and fetching is the faster way."""

    uses_holdings = True

    def __init__(self, prefill_tokens_per_s: float = 400.0, queue_s: float = 0.05,
                 fetch_tokens_per_s: float = 16000.0) -> None:
        for name, value in (("prefill_tokens_per_s", prefill_tokens_per_s), ("queue_s", queue_s),
                            ("fetch_tokens_per_s", fetch_tokens_per_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ValueError(f"cache_aware router: {name} must be a number >= 0, got {value!r}")
        if prefill_tokens_per_s == 0:
            raise ValueError("cache_aware router: prefill_tokens_per_s must be > 0")
        self.rate, self.queue_s, self.fetch_rate = float(prefill_tokens_per_s), float(queue_s), float(fetch_tokens_per_s)

    def _fetches(self, own: int, held: int) -> bool:
        """Is fetching ``held - own`` tokens faster than computing them?"""
        return held > own and self.fetch_rate > self.rate

    def estimate_s(self, request: RoutingRequest, replica: ReplicaStatus, held: int = 0) -> float:
        """Seconds to the first token through ``replica``, as far as the choice of it changes them
        (``held``: the most of the prompt's prefix any replica has stored, which it could fetch;
        blocks a replica is still computing cannot be fetched yet)."""
        own = replica.cached_tokens or 0
        fetched = held - own if self._fetches(own, held) else 0
        uncached = max(0, len(request.prompt_ids) - own - fetched)
        return replica.load * self.queue_s + uncached / self.rate + (fetched / self.fetch_rate if fetched else 0.0)

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        if all(r.cached_tokens is None for r in replicas):
            return min(replicas, key=lambda r: (r.load, r.replica)).replica
        held = max(r.stored_tokens or 0 for r in replicas)
        return min(replicas, key=lambda r: (self.estimate_s(request, r, held), r.load, r.replica)).replica

    def fetch_from(self, stage: str, request: RoutingRequest, picked: int, replicas: list[ReplicaStatus]) -> int | None:
        own = next((r.cached_tokens or 0 for r in replicas if r.replica == picked), 0)
        others = [r for r in replicas if r.replica != picked]
        if not others:
            return None
        holder = max(others, key=lambda r: (r.stored_tokens or 0, -r.load, -r.replica))
        return holder.replica if self._fetches(own, holder.stored_tokens or 0) else None
