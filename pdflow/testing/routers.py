"""A router for tests and experiments of fetching a prefix between stores: named in a topology as
``"pdflow.testing.routers:AwayRouter"``."""

from __future__ import annotations

from pdflow.routing.policies import CacheAwareRouter

__all__ = ["AwayRouter"]


class AwayRouter(CacheAwareRouter):
    """Every request to the kv-shuttle replica that holds the least of its prefix (the lowest
    numbered of those), told to fetch it from the one that holds the most, as ``cache_aware``
    does when the holder is busy (``lie``: from a replica that holds none of it, as when ingress's
    picture is stale). Every other stage as ``cache_aware``."""

    def __init__(self, lie: bool = False, **options) -> None:
        super().__init__(**options)
        self.lie = lie

    def pick(self, stage, request, replicas):
        if stage != "kv_shuttle":
            return super().pick(stage, request, replicas)
        return min(replicas, key=lambda r: (r.cached_tokens or 0, r.replica)).replica

    def fetch_from(self, stage, request, picked, replicas):
        if self.lie:
            return next((r.replica for r in replicas if r.replica != picked and not r.stored_tokens), None)
        return super().fetch_from(stage, request, picked, replicas)
