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
