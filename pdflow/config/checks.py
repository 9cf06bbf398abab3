"""Checks on a topology that span several keys or ask other modules: port clashes, installed
transports, known model names.

The other modules are imported lazily, inside the functions, so that loading a topology never pulls
in torch or a transport's library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.config.toml_reader import TableReader
    from pdflow.config.topology import Topology

_BUILTIN_MODELS = frozenset({"smollm2"})
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})
_HOST_ALIASES = {"localhost": "127.0.0.1", "::1": "127.0.0.1", "[::1]": "127.0.0.1"}


def known_models() -> frozenset[str]:
    try:
        from pdflow.models import KNOWN_MODELS
    except ImportError:
        return _BUILTIN_MODELS
    return frozenset(KNOWN_MODELS)


def transport_problem(name: str) -> str | None:
    """None when transport ``name`` can link two stage processes here, else why not."""
    from pdflow.transports import availability, load

    problem = availability(name)
    if problem is None and not load(name).cross_process:
        problem = "it connects peers inside one process only (for tests); stages run as separate processes"
    return problem


@dataclass(frozen=True, slots=True)
class _Endpoint:
    host: str
    port: int
    key: str  # the key that sets it
    offset: int = 0  # port = value of key + offset
    label: str = ""  # what the offset means: "replica 2", "the PUB socket"

    def describe(self) -> str:
        return self.key if not self.offset else f"{self.key} + {self.offset} ({self.label})"

    def overlaps(self, other: _Endpoint) -> bool:
        if self.port != other.port:
            return False
        a, b = (_HOST_ALIASES.get(h, h) for h in (self.host, other.host))
        return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


def _endpoints(topology: Topology) -> list[_Endpoint]:
    server, control = topology.server, topology.control
    found = [
        _Endpoint(server.host, server.port, "server.port"),
        _Endpoint(control.host, control.port, "control.port"),
        _Endpoint(control.host, control.port + 1, "control.port", 1, "the PUB socket"),
    ]
    for name, stage in topology.stages.items():
        bases = [("port", stage.port)] + ([("data_port", stage.data_port)] if stage.data_port else [])
        for field, base in bases:
            found += [
                _Endpoint(stage.host, base + i, f"stages.{name}.{field}", i, f"replica {i}")
                for i in range(stage.replicas)
            ]
    return found


def check_ports(r: TableReader, topology: Topology) -> None:
    """Every endpoint in range, and no two on the same host and port (0.0.0.0 is every host)."""
    seen: list[_Endpoint] = []
    for endpoint in _endpoints(topology):
        if endpoint.port > 65535:
            raise r.error(endpoint.key, f"{endpoint.describe()} would be port {endpoint.port}; "
                          "ports must be in 1..65535 (lower the port or the replicas)")
        for other in seen:
            if endpoint.overlaps(other):
                raise _clash(r, endpoint, other)
        seen.append(endpoint)


def _clash(r: TableReader, later: _Endpoint, earlier: _Endpoint) -> Exception:
    """Blame the later endpoint, unless only the earlier one is written in the file."""
    blamed, other = later, earlier
    if r.lines.line_of(later.key) is None and r.lines.line_of(earlier.key) is not None:
        blamed, other = earlier, later
    own = f" ({blamed.label}, {blamed.key} + {blamed.offset})" if blamed.offset else ""
    hosts = "" if blamed.host == other.host else f" ({blamed.host} and {other.host} overlap)"
    return r.error(blamed.key, f"port {blamed.port}{own} is also used by {other.describe()}{hosts}")
