"""Routers: how ingress picks the replica of each stage that serves a request.

Built-in policies: ``round_robin`` (the default), ``least_loaded``, ``power_of_two`` and
``cache_aware`` (the kv-shuttle replica that holds most of the prompt's prefix, weighed against
its load: an estimate of the time to first token); a
third-party router arrives through the ``pdflow.routers`` entry-point group (or is named as
``"module:Class"``). Select one in the topology::

    [router]
    policy = "least_loaded"
"""

from __future__ import annotations

from typing import Any

from pdflow import plugins
from pdflow.routing.base import NoReplicaAvailable, ReplicaStatus, Router, RoutingRequest

__all__ = ["NoReplicaAvailable", "ReplicaStatus", "Router", "RoutingRequest", "create", "registry"]

registry = plugins.routers
BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group

def create(policy: str | type, options: dict[str, Any] | None = None) -> Router:
    """A router of ``policy`` built with ``options`` (TypeError naming an option it does not take)."""
    cls = registry.load(policy)
    try:
        return cls(**(options or {}))
    except TypeError as exc:
        raise TypeError(f"router {policy!r}: {exc}") from None
