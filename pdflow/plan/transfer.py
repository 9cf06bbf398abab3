"""How long a link takes to move a prompt's KV, with and without layer streaming.

Link speeds are decimal, as network links are sold: 1 Gbit/s = 10^9 bits per second = 125 MB/s
(400 Gbit/s moves 50 GB of KV a second, 46.6 GiB).

Without streaming the transfer starts when prefill ends, and decode waits for all of it: the
*tail* (what a request waits between prefill's end and decode holding every layer) is
``bytes / bandwidth`` (+ the link's latency).

With streaming (pdflow's ``kv_streaming = "layer"``) each layer leaves once prefill computed it.
Prefill of ``P`` seconds makes one of ``L`` layers every ``P / L``; the link takes ``t`` per
layer. Each layer's send starts when it is computed or when the one before it has left,
whichever is later, so the last one arrives ``max(t, P/L + L t - P)`` after prefill ends (+ the
latency): just the last layer when the link keeps up with prefill (``t <= P / L``), else the
backlog it built. Without a prefill time the best case is given (the last layer alone).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Transfer", "bytes_per_s", "transfer"]


def bytes_per_s(gbit_per_s: float) -> float:
    """Decimal Gbit/s to bytes per second."""
    if gbit_per_s <= 0:
        raise ValueError(f"a link speed must be > 0 Gbit/s, got {gbit_per_s:g}")
    return gbit_per_s * 1e9 / 8


@dataclass(frozen=True, slots=True)
class Transfer:
    gbit_per_s: float
    total_bytes: float
    whole_s: float  # every byte, start to end (+ latency): the tail without streaming
    per_layer_s: float
    streamed_tail_s: float  # after prefill ends, with layer streaming (best case without prefill_s)
    prefill_s: float | None  # as given (tokens / prefill speed)
    layers: int = 1

    @property
    def link_keeps_up(self) -> bool | None:
        """Whether the link moves a layer faster than prefill computes one (None: unknown)."""
        return None if self.prefill_s is None else self.per_layer_s <= self.prefill_s / self.layers


def transfer(total_bytes: float, layers: int, gbit_per_s: float, prefill_s: float | None = None,
             latency_s: float = 0.0) -> Transfer:
    """The transfer of ``total_bytes`` of KV over ``layers`` layers on one link."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if prefill_s is not None and prefill_s < 0:
        raise ValueError(f"prefill time must be >= 0 s, got {prefill_s:g}")
    whole = total_bytes / bytes_per_s(gbit_per_s)
    per_layer = whole / layers
    tail = per_layer if prefill_s is None else max(per_layer, prefill_s / layers + whole - prefill_s)
    return Transfer(gbit_per_s, total_bytes, whole + latency_s, per_layer, tail + latency_s, prefill_s, layers)
