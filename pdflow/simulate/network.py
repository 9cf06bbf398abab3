"""Where the KV crosses the network in a simulated cluster: one NIC per host, each direction a
link of its own that carries one transfer after another, and the placement of the stores.

Every prefill replica and every decode replica is a host (one 8-GPU machine, in the roofline
profile); where the stores live is the placement:

- ``central``: the stores are hosts of their own. A request's new KV leaves its prefill host,
  goes into its store's host and out again to decode, and a cached prefix leaves the store's host
  for prefill and for decode: every byte crosses twice, and the stores' NICs carry them all.
- ``beside``: store *i* runs on prefill host *i* (ingress pairs them, :mod:`pdflow.routing.locality`):
  prefill writes into it over loopback, and every byte of a request's KV, cached or new, leaves that
  host once, for decode.
- ``direct`` (``kv.direct``): as ``beside`` on the network: the new KV goes from prefill straight to
  decode, the prefix from the store beside it, each byte once. (The store's relay, which the direct
  path takes off the KV tail, costs no time in this fluid model: the two differ only in a real run,
  ``experiments/experiment_hosts.py``.)

A transfer streamed layer by layer moves through its hops cut-through: each hop starts once its
link is free and the hop before it has started, and ends no sooner than the hop before it and its
own bytes' time after its start. Not modelled: congestion beyond each NIC's own queue (the fabric
is non-blocking), a prefix fetched from a peer store (its bytes are counted, its time is the
router's ``fetch`` figure, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("central", "beside", "direct")

__all__ = ["PLACEMENTS", "Network", "Nic"]


@dataclass(slots=True)
class Nic:
    """One host's NIC: each direction carries one transfer at a time, at ``rate`` bytes/s."""

    rate: float
    tx_free: float = 0.0
    rx_free: float = 0.0
    tx_bytes: float = 0.0
    rx_bytes: float = 0.0


Hop = tuple[Nic, str, float]  # (a NIC, "tx" or "rx", bytes)


class Network:
    def __init__(self, placement: str, prefills: int, decodes: int, stores: int, rate: float,
                 latency_s: float) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}")
        if placement != "central" and stores != prefills:
            raise ValueError(f"placement {placement!r} runs a store beside each prefill host: stores must equal "
                             f"prefill replicas ({prefills}), not {stores}")
        self.placement, self.latency_s = placement, latency_s
        self.prefill = [Nic(rate) for _ in range(prefills)]
        self.decode = [Nic(rate) for _ in range(decodes)]
        self.stores = [Nic(rate) for _ in range(stores)] if placement == "central" else []
        self.prompt_kv_bytes = 0.0  # every request's prompt KV, which decode (or the store) must get
        self.fetched_bytes = 0.0  # prefixes fetched from a peer store

    @property
    def paired(self) -> bool:
        """Store *i* sits on prefill host *i* (ingress routes a request to the two together)."""
        return self.placement != "central"

    def _store_nic(self, store: int) -> Nic:
        return self.stores[store] if self.stores else self.prefill[store]

    def kv_hops(self, prefill: int, store: int, decode: int | None, computed: float, every: float) -> list[Hop]:
        """The hops of one request's KV after its prefill: ``computed`` bytes new, ``every`` bytes
        in all (new and cached); ``decode`` None: it ends at prefill, its KV goes to the store only."""
        self.prompt_kv_bytes += every
        p = self.prefill[prefill]
        if self.placement == "central":
            s = self.stores[store]
            hops = [(p, "tx", computed), (s, "rx", computed)]
            return hops if decode is None else hops + [(s, "tx", every), (self.decode[decode], "rx", every)]
        return [] if decode is None else [(p, "tx", every), (self.decode[decode], "rx", every)]

    def prefix_hops(self, prefill: int, store: int, cached: float) -> list[Hop]:
        """The hops of a cached prefix from the store to prefill (none from the store beside it)."""
        if self.placement != "central" or not cached:
            return []
        return [(self.stores[store], "tx", cached), (self.prefill[prefill], "rx", cached)]

    def fetched(self, holder: int, store: int, nbytes: float) -> None:
        """A prefix fetched from store ``holder`` into store ``store``: counted on their NICs."""
        self.fetched_bytes += nbytes
        self._store_nic(holder).tx_bytes += nbytes
        self._store_nic(store).rx_bytes += nbytes

    def stream(self, hops: list[Hop], start: float, floor: float) -> float:
        """When the last byte of a transfer over ``hops`` is in: its first byte may go at
        ``start``, each hop once its link is free and the hop before it has begun (cut-through),
        and it ends no sooner than ``floor`` (layer streaming: the last layer's own send after
        prefill ends) nor than each hop's own bytes' time after its start; then each link's latency."""
        end, links = floor, 0
        for nic, way, nbytes in hops:
            if nbytes <= 0:
                continue
            start = max(start, nic.tx_free if way == "tx" else nic.rx_free)
            end = max(end, start + nbytes / nic.rate)
            if way == "tx":
                nic.tx_free, nic.tx_bytes = end, nic.tx_bytes + nbytes
            else:
                nic.rx_free, nic.rx_bytes = end, nic.rx_bytes + nbytes
                links += 1
        return end + links * self.latency_s

    def stats(self, duration_s: float) -> dict:
        """The bytes that crossed the network and how busy the busiest NIC direction was."""
        nics = [*self.prefill, *self.decode, *self.stores]
        sent = sum(nic.tx_bytes for nic in nics)

        def busiest(group: list[Nic]) -> float:
            if not group or duration_s <= 0:
                return 0.0
            return max(max(nic.tx_bytes, nic.rx_bytes) for nic in group) / (group[0].rate * duration_s)

        return {"placement": self.placement, "kv_network_bytes": sent, "prompt_kv_bytes": self.prompt_kv_bytes,
                "kv_crossings": sent / self.prompt_kv_bytes if self.prompt_kv_bytes else 0.0,
                "fetched_bytes": self.fetched_bytes,
                "busiest_nic": {"prefill": busiest(self.prefill), "decode": busiest(self.decode),
                                "store": busiest(self.stores)}}
