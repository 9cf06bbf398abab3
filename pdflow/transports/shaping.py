"""Link emulation: a per-link ``bandwidth`` and ``latency`` that every transport honours.

A link in topology.toml may ask for a slower wire than the one it runs on::

    [[links]]
    src = "prefill"
    dst = "kv_shuttle"
    transport = "tcp"
    options = { bandwidth = "25Gbit", latency = "250us" }

:func:`pdflow.transports.create` takes these two options away from the transport's own and
wraps the transport in a :class:`ShapedTransport`, which delegates everything and adds:

- **bandwidth, on the sender** (``write()``): a token bucket of payload bytes, refilled at
  ``bandwidth`` and holding at most :func:`burst_bytes` (5 ms of the rate, at least 64 KiB:
  a few KV chunks, as a NIC's queue would). It starts full. A write takes ``nbytes`` tokens
  when called, in call order; if that leaves the bucket in debt, the chunk is handed to the
  transport only once the debt is repaid. So a stream of writes never goes faster than
  ``bandwidth``; a chunk bigger than the bucket is not split, it simply waits longer. A write
  that fails still spent its tokens, as bytes lost on a wire do. Headers are not counted.
- **latency, on the receiver** (``next_notice()``): propagation delay. A notice is handed out
  no earlier than ``latency`` after its bytes landed, and its ``received_at`` says when that
  is. The sender never waits for it, so writes in a row pay the latency once, overlapped, as
  on a real wire, not once per chunk (a sleep in ``write()`` would charge prefill's 60
  sequential layer writes 60 times). The bytes are in the region earlier, but the contract
  already says not to read a span before its notice.

Both ends of a link get its options (every stage creates its sending and its receiving
transport from the same ``[[links]]`` table), so each applies its half. Alone, a sender given
only ``latency`` delays nothing, and a receiver given only ``bandwidth`` never writes.

This is a sleep-based lower bound on time, not a model of congestion, loss or a slow peer:
a transport slower than ``bandwidth`` stays as slow as it is.

**Faults, on the sender**, for fault-injection runs (:class:`LinkFaults`): ``drop`` (the fraction
of chunks that never arrive: the write returns as if sent), ``corrupt`` (the fraction that arrive
with one bit flipped, their checksum as it was: the receiver's notice carries ChecksumMismatch)
and ``stall`` (the fraction held back ``stall_s`` seconds, 1 by default, before they go), drawn
from a generator seeded by ``fault_seed`` (0).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport, byte_view
from pdflow.transports.delegating import DelegatingTransport
from pdflow.transports.errors import ChunkNotice, TransportClosed

__all__ = [
    "OPTIONS",
    "LinkFaults",
    "ShapedTransport",
    "TokenBucket",
    "burst_bytes",
    "check_link_options",
    "parse_bandwidth",
    "parse_latency",
]

OPTIONS = ("bandwidth", "latency", "drop", "corrupt", "stall", "stall_s", "fault_seed")
BURST_S = 0.005
MIN_BURST = 64 << 10

_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # prefix case is free
_BYTES = {"B": 1, "KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}  # fmt: skip
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?\s*([^\d\s./][^\s/]*)(/s)?\s*")
_BANDWIDTH_UNITS = "bit, Kbit, Mbit, Gbit, Tbit (bits per second) or B, KB, MB, GB, TB, KiB, MiB, GiB (bytes)"


def _shown(option: str, value: Any) -> str:
    return f"{option} = {json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)}"


def _quantity(option: str, value: Any, example: str) -> tuple[float, str]:
    if not isinstance(value, str):
        raise ValueError(f"{_shown(option, value)}: expected a string with a unit, e.g. {json.dumps(example)}")
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(f"{_shown(option, value)}: expected a number and a unit, e.g. {json.dumps(example)}")
    digits, exponent, unit, _ = match.groups()
    return float(digits) * 10 ** int(exponent or 0), unit


def parse_bandwidth(value: Any, option: str = "bandwidth") -> float:
    """``"10Gbit"``, ``"800Mbit"``, ``"2GB"`` (``/s`` optional) -> bytes per second (> 0).

    Prefixes are decimal (``K`` = 1000) except the explicit ``KiB``, ``MiB``, ``GiB``. ValueError
    naming ``option`` for anything else, including the ambiguous ``Mb`` and ``Gbps``.
    """
    number, unit = _quantity(option, value, "10Gbit")
    if unit.lower() in _BITS:
        rate = number * _BITS[unit.lower()] / 8
    elif unit in _BYTES:
        rate = number * _BYTES[unit]
    else:
        hint = ("; 'bps' is bits in some tools and bytes in others, so write Gbit or GB"
                if unit.lower().endswith("bps") else
                "; lower-case 'b' could be bits or bytes, so write Mbit or MB"
                if unit.lower() in {"b", "kb", "mb", "gb", "tb"} else "")  # fmt: skip
        raise ValueError(f"{_shown(option, value)}: unknown unit {unit!r}{hint}; expected {_BANDWIDTH_UNITS}")
    if rate <= 0:
        raise ValueError(f"{_shown(option, value)}: a bandwidth must be > 0")
    return rate


def parse_size(value: Any, option: str = "size") -> int:
    """``"4GiB"``, ``"512MiB"``, ``"2GB"`` or a plain integer of bytes -> bytes (> 0); ValueError
    naming ``option`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        number, unit = _quantity(option, value, "4GiB")
        if unit not in _BYTES:
            raise ValueError(f"{_shown(option, value)}: unknown unit {unit!r}; expected B, KB, MB, GB, TB, KiB, MiB "
                             "or GiB")
        size = int(number * _BYTES[unit])
    if size <= 0:
        raise ValueError(f"{_shown(option, value)}: a size must be > 0")
    return size


def parse_latency(value: Any, option: str = "latency") -> float:
    """``"1ms"``, ``"250us"``, ``"0.5s"`` (also ``ns``, ``µs``) -> seconds (>= 0); ValueError
    naming ``option`` otherwise."""
    number, unit = _quantity(option, value, "1ms")
    if unit not in _SECONDS:
        raise ValueError(f"{_shown(option, value)}: unknown unit {unit!r}; expected one of ns, us, ms, s")
    return number * _SECONDS[unit]


def check_link_options(options: dict[str, Any]) -> str | None:
    """None if a link's ``bandwidth`` and ``latency`` options (if any) are valid, else why not
    (the message starts with the option, e.g. ``bandwidth = "fast": ...``). Other options are
    the transport's business."""
    try:
        if "bandwidth" in options:
            parse_bandwidth(options["bandwidth"])
        if "latency" in options:
            parse_latency(options["latency"])
        LinkFaults.from_options(options)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class LinkFaults:
    """What an emulated link does wrong (see the module docstring)."""

    drop: float = 0.0
    corrupt: float = 0.0
    stall: float = 0.0
    stall_s: float = 1.0
    seed: int = 0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> LinkFaults | None:
        """The faults ``options`` ask for (None: none); ValueError naming a bad option."""
        fractions = {}
        for name in ("drop", "corrupt", "stall"):
            value = options.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} = {json.dumps(value)}: expected a fraction of chunks in [0, 1]")
            fractions[name] = float(value)
        if sum(fractions.values()) > 1:
            raise ValueError("drop + corrupt + stall: the fractions add up to more than 1")
        stall_s = options.get("stall_s", 1.0)
        if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or stall_s < 0:
            raise ValueError(f"stall_s = {json.dumps(stall_s)}: expected seconds >= 0")
        seed = options.get("fault_seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"fault_seed = {json.dumps(seed)}: expected an integer")
        if not any(fractions.values()):
            return None
        return cls(**fractions, stall_s=float(stall_s), seed=seed)


def burst_bytes(rate: float) -> int:
    """The token bucket's depth for ``rate`` bytes/s: 5 ms of it, at least 64 KiB."""
    return max(MIN_BURST, int(rate * BURST_S))


class TokenBucket:
    """Payload bytes allowed onto the wire: refilled at ``rate`` per second up to ``depth``."""

    def __init__(self, rate: float, depth: float) -> None:
        self.rate, self.depth = rate, depth
        self._tokens, self._stamp = depth, time.monotonic()

    def take(self, nbytes: int) -> float:
        """Take ``nbytes`` now (going into debt if need be); returns the ``time.monotonic()``
        at which the debt is repaid, i.e. when these bytes may go (the past: at once)."""
        now = time.monotonic()
        self._tokens = min(self.depth, self._tokens + (now - self._stamp) * self.rate) - nbytes
        self._stamp = now
        return now + max(0.0, -self._tokens) / self.rate


class ShapedTransport(DelegatingTransport):
    """``inner`` behind an emulated link; see the module docstring for the model.

    ``bandwidth`` is in bytes per second (None: unlimited), ``latency`` in seconds. Every other
    attribute and method is the inner transport's.
    """

    def __init__(self, inner: Transport, bandwidth: float | None = None, latency: float = 0.0,
                 faults: LinkFaults | None = None) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0 s, got {latency}")
        super().__init__(inner)
        self.bandwidth, self.latency = bandwidth, latency
        self._bucket = TokenBucket(bandwidth, burst_bytes(bandwidth)) if bandwidth else None
        self._in_order = asyncio.Lock()  # writes leave the bucket in call order
        self._held: ChunkNotice | None = None  # landed, its latency not yet over
        self._handing_out = asyncio.Lock()
        self._closing = asyncio.Event()
        self.faults = faults
        self._rng = random.Random(faults.seed) if faults else None
        self.injected = {"dropped": 0, "corrupted": 0, "stalled": 0}

    def __repr__(self) -> str:
        return (f"ShapedTransport({self.inner!r}, bandwidth={self.bandwidth}, latency={self.latency}, "
                f"faults={self.faults})")

    async def peer_memory(self, address: str, region: int) -> memoryview | None:
        return None  # the emulated wire must carry the bytes: no writing straight into a peer's memory

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        if self.faults is not None and not self._closing.is_set():
            data = await self._misbehave(header, data)
            if data is None:
                return  # dropped: as if sent
        if self._bucket is None or self._closing.is_set():
            return await self.inner.write(address, header, data)
        go_at = self._bucket.take(max(header.nbytes, 0))
        async with self._in_order:  # FIFO; go_at only grows, so no one waits past their own time
            await self._sleep_until(go_at)  # cut short by aclose(); inner.write then raises
        # no await between leaving the lock and starting the write: the order holds in inner too
        return await self.inner.write(address, header, data)

    async def _misbehave(self, header: KvChunkHeader, data: Any) -> Any:
        """``data`` as the faulty link delivers it: None (dropped), a corrupted copy, or itself
        (after a stall, perhaps)."""
        f, roll = self.faults, self._rng.random()
        if roll < f.drop:
            self.injected["dropped"] += 1
            return None
        if roll < f.drop + f.corrupt and header.nbytes > 0:
            self.injected["corrupted"] += 1
            copy = bytearray(byte_view(data))
            copy[self._rng.randrange(len(copy))] ^= 1 << self._rng.randrange(8)
            return copy
        if roll < f.drop + f.corrupt + f.stall:
            self.injected["stalled"] += 1
            await self._sleep_until(time.monotonic() + f.stall_s)
        return data

    async def next_notice(self) -> ChunkNotice:
        if self.latency <= 0:
            return await self.inner.next_notice()
        async with self._handing_out:  # one at a time, and a cancelled call loses no notice
            if self._held is None:
                notice = await self.inner.next_notice()
                landed = notice.received_at or time.monotonic()  # 0.0: the transport did not say
                self._held = ChunkNotice(notice.header, notice.error, landed + self.latency)
            await self._sleep_until(self._held.received_at)  # cut short by aclose()
            if self._closing.is_set():
                raise TransportClosed(f"{self.inner.name} transport is closed")
            notice, self._held = self._held, None
            return notice

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0 and not self._closing.is_set():
            try:
                await asyncio.wait_for(self._closing.wait(), delay)
            except TimeoutError:
                pass

    async def aclose(self) -> None:
        self._closing.set()
        await self.inner.aclose()
