"""Host locality in ingress's routing (pdflow/routing/locality.py): across machines a request's
prefill and the store it writes into share a host, so its KV crosses the network once (store ->
decode). The routes are ingress's own (`IngressStage._route` over a parsed multi-host topology),
with no process started."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pdflow import routing
from pdflow.config.topology import TopologyError, parse_topology
from pdflow.routing import locality
from pdflow.serving.openai_protocol import ApiError
from pdflow.stages.ingress import IngressStage
from pdflow.transports import shares_memory

HOSTS = ['[security]', 'secret_env = "PDFLOW_SECRET"',
         '[hosts.head]', 'address = "10.0.0.1"', '[hosts.p1]', 'address = "10.0.0.2"',
         '[hosts.p2]', 'address = "10.0.0.3"', '[hosts.d1]', 'address = "10.0.0.4"']
# a store beside each prefill host, decode on a third
SPREAD = ['[stages.prefill]', 'replicas = 3', 'on = ["p1", "p2", "p2"]',
          '[stages.kv_shuttle]', 'replicas = 2', 'on = ["p1", "p2"]',
          '[stages.decode]', 'replicas = 2', 'on = "d1"']


def parse(*lines: str):
    return parse_topology("\n".join(lines) + "\n", Path("topo.toml"))


def ingress_of(pipeline, policy: str = "round_robin") -> IngressStage:
    """An ingress that routes as the real one does (its routing state only, nothing started)."""
    stage = IngressStage.__new__(IngressStage)
    stage.pipeline, stage.replica = pipeline, 0
    stage.down, stage.unrouted = set(), set()
    stage.reported, stage.assigned = {}, Counter()
    stage.holdings, stage.hasher = None, None
    stage.router = routing.create(policy, {})
    stage.routed = [name for name in pipeline.stages if name != "ingress"]
    stage.keeps_kv = locality.kv_stages(pipeline, "holds_kv")
    stage.pairings = locality.pairings(pipeline, shares_memory)
    stage.route_order = locality.route_order(stage.routed, stage.pairings)
    stage.hosts_of = {name: [pipeline.host_name_of(name, i) for i in range(pipeline.stages[name].replicas)]
                      for name in stage.routed}
    return stage


def hosts_of(pipeline, route) -> tuple[str, str]:
    return (pipeline.host_name_of("prefill", route.of("prefill")),
            pipeline.host_name_of("kv_shuttle", route.of("kv_shuttle")))


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "cache_aware"])
def test_every_request_s_prefill_writes_into_the_store_on_its_own_host(policy) -> None:
    pipeline = parse(*HOSTS, *SPREAD)
    assert pipeline.router.locality == "host"
    ingress = ingress_of(pipeline, policy)
    assert ingress.route_order == ["kv_shuttle", "prefill", "decode"]  # the store first, then a prefill beside it
    seen = Counter()
    for i in range(60):
        route = ingress._route(f"r{i}", [1, 2, 3])
        ingress.assigned.update(route.replicas.items())
        prefill_host, store_host = hosts_of(pipeline, route)
        assert prefill_host == store_host
        seen[(route.of("prefill"), route.of("kv_shuttle"))] += 1
    if policy in ("round_robin", "least_loaded"):  # the load still spreads over every pair
        assert set(seen) == {(0, 0), (1, 1), (2, 1)}


def test_without_locality_the_replicas_are_picked_on_their_own_and_the_kv_crosses_hosts_twice() -> None:
    pipeline = parse(*HOSTS, *SPREAD, '[router]', 'locality = "none"')
    ingress = ingress_of(pipeline)
    assert ingress.pairings == [] and ingress.route_order == ["prefill", "kv_shuttle", "decode"]
    apart = sum(len(set(hosts_of(pipeline, ingress._route(f"r{i}", [1])))) > 1 for i in range(12))
    assert apart > 0


def test_a_store_whose_host_has_no_prefill_up_takes_none_and_the_pairs_that_remain_serve() -> None:
    pipeline = parse(*HOSTS, *SPREAD)
    ingress = ingress_of(pipeline)
    ingress.down.add(("prefill", 0))  # p1's only prefill
    for i in range(8):
        assert hosts_of(pipeline, ingress._route(f"r{i}", [1])) == ("p2", "p2")
    ingress.down.add(("kv_shuttle", 1))  # p2's store too: no pair left, so any of each (tcp can cross)
    route = ingress._route("last", [1])
    assert (route.of("prefill"), route.of("kv_shuttle")) in {(1, 0), (2, 0)}


def test_one_host_routes_as_before() -> None:
    pipeline = parse('[stages.prefill]', 'replicas = 2', '[stages.kv_shuttle]', 'replicas = 2')
    ingress = ingress_of(pipeline)
    assert not pipeline.multi_host and ingress.pairings == []
    picks = {(r.of("prefill"), r.of("kv_shuttle")) for r in (ingress._route(f"r{i}", [1]) for i in range(4))}
    assert picks == {(0, 0), (1, 1)}  # round robin, each stage on its own


def test_restrict_keeps_a_strict_pairing_even_when_nothing_is_left() -> None:
    assert locality.restrict([True, True], ["a", "b"], {"b"}, strict=False) == [False, True]
    assert locality.restrict([True, False], ["a", "b"], {"b"}, strict=False) == [True, False]  # none there: any
    assert locality.restrict([True, False], ["a", "b"], {"b"}, strict=True) == [False, False]  # none at all


def test_no_replica_left_is_a_503_naming_the_stage() -> None:
    pipeline = parse(*HOSTS, *SPREAD)
    ingress = ingress_of(pipeline)
    ingress.down.update({("kv_shuttle", 0), ("kv_shuttle", 1)})
    with pytest.raises(ApiError) as caught:
        ingress._route("r", [1])
    assert caught.value.status == 503 and "kv-shuttle" in str(caught.value)


def test_locality_is_checked_in_the_topology() -> None:
    with pytest.raises(TopologyError) as caught:
        parse('[router]', 'locality = "rack"')
    assert caught.value.key == "router.locality" and "host, none" in caught.value.message


def test_decode_is_not_paired_with_the_store_it_reads_from() -> None:
    pipeline = parse(*HOSTS, '[stages.prefill]', 'on = "p2"', '[stages.kv_shuttle]', 'on = "p2"',
                     '[stages.decode]', 'replicas = 2', 'on = ["p1", "d1"]')
    ingress = ingress_of(pipeline)
    assert [(p.producer, p.store) for p in ingress.pairings] == [("prefill", "kv_shuttle")]
    assert {ingress._route(f"r{i}", [1]).of("decode") for i in range(4)} == {0, 1}


def test_validate_says_which_links_cross_hosts(tmp_path, capsys) -> None:
    from pdflow.cli import main

    path = tmp_path / "topo.toml"
    path.write_text("\n".join([*HOSTS, *SPREAD]) + "\n")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "link prefill -> kv_shuttle: tcp\n    stays on each host (p1, p2): router.locality pairs" in out
    assert "link kv_shuttle -> decode: tcp\n    crosses hosts: p1 -> d1, p2 -> d1\n" in out
    path.write_text("\n".join([*HOSTS, *SPREAD, '[router]', 'locality = "none"']) + "\n")
    assert main(["validate", str(path)]) == 0
    assert "link prefill -> kv_shuttle: tcp\n    crosses hosts: p1 -> p2, p2 -> p1 (and stays on one host where both run)" \
        in capsys.readouterr().out


SHM_INTO_STORE = ['[[links]]', 'src = "prefill"', 'dst = "kv_shuttle"', 'transport = "shm"']


def test_a_store_beside_each_prefill_takes_its_kv_over_shm_and_decode_s_answers_over_the_network() -> None:
    pipeline = parse(*HOSTS, *SPREAD, *SHM_INTO_STORE)
    links = {(link.src, link.dst): link.transport for link in pipeline.links}
    assert links == {("prefill", "kv_shuttle"): "shm", ("kv_shuttle", "prefill"): "shm",
                     ("kv_shuttle", "decode"): "tcp", ("decode", "kv_shuttle"): "tcp"}
    ingress = ingress_of(pipeline)
    assert [p.strict for p in ingress.pairings] == [True]
    ingress.down.add(("prefill", 0))  # p1's store has no prefill up: over shm nothing else can write it
    assert {hosts_of(pipeline, ingress._route(f"r{i}", [1])) for i in range(6)} == {("p2", "p2")}
    ingress.down.add(("kv_shuttle", 1))  # nor can a prefill on p2 write p1's store
    with pytest.raises(ApiError) as caught:
        ingress._route("none", [1])
    assert caught.value.status == 503


@pytest.mark.parametrize("lines, fragment", [
    (['[stages.prefill]', 'replicas = 2', 'on = ["p1", "p2"]', '[stages.kv_shuttle]', 'on = "p1"',
      '[stages.decode]', 'on = "d1"'], "shares memory on one machine"),  # p2's prefill has no store beside it
    ([*SPREAD, '[router]', 'locality = "none"'], "shares memory on one machine"),  # nothing pairs them
])
def test_shm_across_hosts_needs_a_store_beside_every_prefill_and_locality(lines, fragment) -> None:
    with pytest.raises(TopologyError) as caught:
        parse(*HOSTS, *lines, *SHM_INTO_STORE)
    assert caught.value.key == "links[0].transport" and fragment in caught.value.message
    assert "run a kv_shuttle beside each prefill host" in caught.value.message


def test_a_stage_receives_over_shm_beside_one_network_transport_and_no_more() -> None:
    one_host = parse(*SHM_INTO_STORE)
    assert {(link.src, link.dst): link.transport for link in one_host.links}[("decode", "kv_shuttle")] == "tcp"
    from pdflow import transports

    if transports.availability("ucx") is not None:
        pytest.skip(transports.availability("ucx"))
    with pytest.raises(TopologyError) as caught:  # two network transports cannot share the data port
        parse('[[links]]', 'src = "prefill"', 'dst = "kv_shuttle"', 'transport = "tcp"',
              '[[links]]', 'src = "decode"', 'dst = "kv_shuttle"', 'transport = "ucx"')
    assert "receives KV on one data port" in caught.value.message
