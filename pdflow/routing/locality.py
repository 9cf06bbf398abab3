"""Host locality: a request's prefill writes its KV into a store on its own host, so that the
KV crosses the network once (store -> decode) instead of twice (prefill -> store -> decode).

With ``router.locality = "host"`` (the default) ingress routes the store first (a cache-aware
router picks it by the prefix it holds), offering only the stores on a host where a prefill
replica is up; then prefill, offering only the replicas on the picked store's host. Where no
such pair is up, a request takes any store and any prefill (its KV then crosses twice), unless
the link between them shares memory (shm): then there is no other way, and the request waits
for a pair (503). On one host every replica shares it, and nothing changes.

``"none"``: each stage's replica is picked on its own, whatever its host (the old shape, kept to
measure against).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.config.pipeline import Pipeline
from pdflow.plugins import stage_kind_kv_trait


@dataclass(frozen=True, slots=True)
class Pairing:
    """A stage that writes KV (``producer``: prefill) and the store it writes into (``store``)."""

    producer: str
    store: str
    strict: bool  # the link between them shares memory: only a store on the producer's host will do


def applies(pipeline: Pipeline) -> bool:
    """Whether ingress keeps producers and stores on one host: ``router.locality = "host"`` in a
    pipeline of several hosts."""
    return pipeline.router.locality != "none" and pipeline.multi_host


def kv_stages(pipeline: Pipeline, trait: str) -> set[str]:
    """The stages whose kind says ``trait``: "computes_kv" (prefill) or "holds_kv" (kv-shuttle,
    the colocated worker); a built-in kind's without importing its class."""
    return {name for name, stage in pipeline.stages.items() if stage_kind_kv_trait(stage.kind_name, trait)}


def pairings(pipeline: Pipeline, shares_memory) -> list[Pairing]:
    """The producer -> store pairs of ``pipeline`` whose replicas ingress should keep on one host
    (none with ``router.locality = "none"``, or in a one-host pipeline): each data-plane link from
    a stage that computes prompts' KV (prefill) into one that holds KV (kv-shuttle).
    ``shares_memory(transport)``: whether a transport stays on one machine. (Decode's link back
    into the store, for answers, is not a pairing: decode goes wherever the router sends it, and
    reads the KV over the network.)"""
    if not applies(pipeline):
        return []
    computes_kv, keeps_kv = kv_stages(pipeline, "computes_kv"), kv_stages(pipeline, "holds_kv")
    return [Pairing(link.src, link.dst, shares_memory(link.transport)) for link in pipeline.links
            if link.src in computes_kv and link.dst in keeps_kv]


def route_order(routed: list[str], found: list[Pairing]) -> list[str]:
    """``routed`` with every paired store moved just before its producer (it is picked first)."""
    order = list(routed)
    for pair in found:
        if pair.store in order and pair.producer in order and order.index(pair.store) > order.index(pair.producer):
            order.remove(pair.store)
            order.insert(order.index(pair.producer), pair.store)
    return order


def restrict(routable: list[bool], hosts: list[str], wanted: set[str], strict: bool) -> list[bool]:
    """``routable`` narrowed to the replicas whose host (``hosts[i]``) is in ``wanted``, where
    one of them is routable (or ``strict``: whatever that leaves)."""
    local = [ok and host in wanted for ok, host in zip(routable, hosts)]
    return local if strict or any(local) else routable


def link_hosts(pipeline: Pipeline, src: str, dst: str, found: list[Pairing]) -> str | None:
    """For ``pdflow validate``: whether the data-plane link ``src -> dst`` crosses hosts (None in
    a one-host pipeline)."""
    if not pipeline.multi_host:
        return None
    src_hosts = {pipeline.host_name_of(src, i) for i in range(pipeline.stages[src].replicas)}
    dst_hosts = {pipeline.host_name_of(dst, i) for i in range(pipeline.stages[dst].replicas)}
    pair = next((p for p in found if {p.producer, p.store} == {src, dst}), None)
    if pair is not None:
        producers = src_hosts if src == pair.producer else dst_hosts
        stores = dst_hosts if src == pair.producer else src_hosts
        if producers <= stores:
            return (f"stays on each host ({', '.join(sorted(producers))}): router.locality pairs each "
                    f"{pair.producer} with the {pair.store} beside it")
        lacking = ", ".join(sorted(producers - stores))
        return f"crosses hosts from {lacking}, where no {pair.store} runs beside {pair.producer} (else on one host)"
    crossing = sorted((a, b) for a in src_hosts for b in dst_hosts if a != b)
    if not crossing:
        return f"stays on host {next(iter(src_hosts))}"
    return "crosses hosts: " + ", ".join(f"{a} -> {b}" for a, b in crossing) + \
        (" (and stays on one host where both run)" if src_hosts & dst_hosts else "")
