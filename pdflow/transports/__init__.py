"""The KV data plane: one-sided transports, found by name (like fsspec's registry).

Built-in transports are ``"module:Class"`` strings with an install hint, imported only when
asked for; third-party ones arrive through the ``pdflow.transports`` entry-point group::

    [project.entry-points."pdflow.transports"]
    mytransport = "mypkg.transport:MyTransport"

``availability(name)`` says whether a transport can be used here (None) or why not, with the
hint; ``create(name, ...)`` builds one. The interface is :class:`Transport` (``base.py``), its
errors are in ``errors.py``.
"""

from __future__ import annotations

from typing import Any

from pdflow import plugins
from pdflow.transports.base import Transport
from pdflow.transports.errors import (
    ChecksumMismatch,
    ChunkNotice,
    IncompatiblePeer,
    OutOfBounds,
    PeerDisconnected,
    PeerUnreachable,
    TransportClosed,
    TransportError,
    UndecodableChunk,
    UnknownRegion,
)
from pdflow.transports.regions import byte_view

__all__ = [
    "BUILTIN",
    "ChecksumMismatch",
    "ChunkNotice",
    "IncompatiblePeer",
    "OutOfBounds",
    "PeerDisconnected",
    "PeerUnreachable",
    "Transport",
    "TransportClosed",
    "TransportError",
    "UndecodableChunk",
    "UnknownRegion",
    "address_host",
    "availability",
    "byte_view",
    "create",
    "load",
    "names",
    "registry",
    "shares_memory",
]

registry = plugins.transports
BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group
names = registry.names  # every known transport: the built-in ones, then those from entry points
availability = registry.availability  # None if usable here, else why not (with the install hint)
load = registry.load  # the class; LookupError if unknown, ImportError if not installed


def shares_memory(name: str) -> bool:
    """Whether transport ``name`` moves KV through memory one machine shares (cannot cross hosts);
    False for one not available here."""
    return availability(name) is None and bool(load(name).shares_memory)


_ON_ONE_MACHINE = ("shm", "inproc")  # address schemes that never leave the machine


def address_host(address: str) -> str | None:
    """The host part of a transport address (``tcp://10.0.0.2:5630`` -> ``10.0.0.2``); None for
    one that cannot leave this machine (``shm://``, ``inproc://``) or has no host."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme in _ON_ONE_MACHINE:
        return None
    netloc = rest.split("/", 1)[0]
    host = netloc.rsplit(":", 1)[0] if ":" in netloc else netloc
    return host.strip("[]") or None


def create(name: str, host: str = "127.0.0.1", port: int = 0, **options: Any) -> Transport:
    """A new, unstarted transport ``name`` listening (once started) on ``host:port``.

    ``bandwidth`` (e.g. ``"10Gbit"``, ``"2GB"``), ``latency`` (e.g. ``"250us"``) and the fault
    options (``drop``, ``corrupt``, ``stall``, ``stall_s``, ``fault_seed``) are taken out of
    ``options`` for any transport: they wrap it in a
    :class:`~pdflow.transports.shaping.ShapedTransport` that emulates such a link (ValueError
    for a malformed value). The other options go to the transport.
    """
    from pdflow.transports.shaping import OPTIONS

    link = {key: options.pop(key) for key in OPTIONS if key in options}
    if not link:
        return load(name)(host, port, **options)
    from pdflow.transports.shaping import LinkFaults, ShapedTransport, parse_bandwidth, parse_latency

    rate = None if "bandwidth" not in link else parse_bandwidth(link["bandwidth"])
    delay = 0.0 if "latency" not in link else parse_latency(link["latency"])
    return ShapedTransport(load(name)(host, port, **options), rate, delay, LinkFaults.from_options(link))
