"""End to end across machines: each stage on a host of its own (a network namespace with its own
address, joined to the others by veth pairs and a bridge, its link shaped by tc), started by
`pdflow run topology.toml --node NAME` in that namespace, as an operator would on each machine.

One pipeline in the default multi-host shape: ingress on `head` (which supervises), a prefill and
a kv-shuttle beside it on each of two prefill hosts, two decode replicas on two more hosts. The
second prefill replica is the scaler's (deciding on `head`): started on its host under a burst and
parked when quiet. Host locality (router.locality) keeps each request's prefill and store on one
host, so its KV crosses the network once, store -> decode (the byte counts say so). It answers what
the engine answers in-process; a decode process killed on its host is restarted by that host's
launcher; a whole host going away is a dead replica to the others (its requests go to the other
decode) until it comes back. KV goes into kv-shuttle over shm from the prefill beside it (which
computes it in the store's blocks), into decode over ucx (tcp where ucxx is not installed), and
decode's answers back into the store over that same network transport, so that the store
receives over two transports and both meet peers that die or vanish. Skipped with the reason
where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pdflow import transports
from pdflow.testing.hosts import Cluster, hosts_topology
from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.netns import Namespaces, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

HOSTS = ("head", "prefill", "prefill-b", "decode-a", "decode-b")
QUESTION = "What is the capital of France?"


PLACEMENT = {"ingress": ["head"], "prefill": ["prefill", "prefill-b"], "kv_shuttle": ["prefill", "prefill-b"],
             "decode": ["decode-a", "decode-b"]}
# prefill-1 (on prefill-b) is the scaler's: parked until prefill holds more than 2 requests for half
# a second; parked again 1.5 s after it holds none
SCALER = """
[scaler]
interval_s = 0.25
window_s = 3
prefill_queue_per_replica = 2
decode_queue_per_replica = 100
tbt_slo_ms = 60000
ttft_slo_ms = 60000
up_after_s = 0.5
down_after_s = 1.5
cooldown_s = 1
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # KV into kv-shuttle over shm (the store beside prefill), into decode over ucx (over its tcp between
    # namespaces: UCX's shared memory cannot wake a peer in another one), where ucxx is installed (asked
    # here, not at collection: the answer imports ucxx, 0.4 s of CPU in each test worker)
    into_decode = "ucx" if transports.availability("ucx") is None else "tcp"
    with Namespaces(HOSTS, bandwidth="10gbit") as net:
        running = Cluster(net, tmp_path_factory.mktemp("hosts"),
                          lambda secret: hosts_topology(net, secret, PLACEMENT, heartbeat_timeout_s=4,
                                                        transports=("shm", into_decode), min_replicas={"prefill": 1},
                                                        extra=SCALER))
        for host in HOSTS:
            running.start(host)
        running.wait(lambda status, body: status == 200, "every stage on every host to be ready")
        yield running


def ask(cluster: Cluster, count: int = 2) -> list[str]:
    client = openai_client(cluster.url, timeout=120)
    return [client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=12).choices[0].message.content
            for _ in range(count)]


@pytest.fixture(scope="module")
def reference(served_model):
    from pdflow.testing.reference import chat_ids, greedy_answer

    loaded, tokenizer = served_model
    return greedy_answer(loaded, tokenizer, chat_ids(tokenizer, QUESTION), 12)


def test_stages_on_five_hosts_answer_as_the_engine_does_over_their_addresses(cluster, reference):
    assert ask(cluster) == [reference, reference]  # round robin: one on each decode host
    # the planes run between the hosts' own addresses: ingress (on head) holds connections to
    # prefill's control port at prefill's address, and kv-shuttle KV connections to decode's
    sockets = cluster.net.run("head", ["ss", "-tnH"]).stdout
    assert f"{cluster.net.address('prefill')}:5520" in sockets, sockets
    sockets = cluster.net.run("prefill", ["ss", "-tnH"]).stdout
    for host in ("decode-a", "decode-b"):
        assert any(f"{cluster.net.address(host)}:{port}" in sockets for port in (5640, 5641)), sockets


def test_the_kv_crosses_the_network_once_from_the_store_beside_prefill(cluster):
    client = openai_client(cluster.url, timeout=120)
    reply = client.completions.create(model="smollm2", prompt="Count on and on: one, two, three,", temperature=0,
                                      max_tokens=140, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 140  # past two blocks of 64: decode writes its answer's back
    time.sleep(1.2)  # a heartbeat after the answers
    stats = {name: info.get("stats", {}) for name, info in cluster.health()[1]["stages"].items()}
    prefill, store = stats["prefill-0"], stats["kv-shuttle-0"]
    # prefill computed into the store beside it (shm, in place): none of it crossed; the store's
    # writes to decode did, and decode's answers came back over the network into the same blocks
    assert prefill["kv_in_place_bytes"] > 0 and prefill["kv_network_bytes@kv-shuttle"] == 0
    assert store["kv_network_bytes@decode"] == store["kv_sent_bytes@decode"] > 0
    assert stats["decode-0"]["kv_network_bytes@kv-shuttle"] == stats["decode-0"]["kv_sent_bytes@kv-shuttle"] > 0
    # and /metrics says the same, per link
    from prometheus_client.parser import text_string_to_metric_families

    network = {(s.labels["stage"], s.labels["replica"], s.labels["peer"]): s.value
               for family in text_string_to_metric_families(local_http().get(f"{cluster.url}/metrics", timeout=10).text)
               if family.name == "pdflow_kv_network_bytes" for s in family.samples}
    assert network[("prefill", "0", "kv-shuttle")] == 0
    assert network[("kv-shuttle", "0", "decode")] == store["kv_network_bytes@decode"]


def test_the_scaler_starts_a_replica_on_its_host_and_parks_it_there(cluster, reference):
    assert cluster.health()[1]["stages"]["prefill-1"]["state"] == "parked"

    async def burst() -> list[str]:  # a client per loop: asyncio.run makes a new one each time
        async with openai_client(cluster.url, asynchronous=True, timeout=120) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12)
                for _ in range(8)))
        return [r.choices[0].message.content for r in replies]

    answers = []
    deadline = time.monotonic() + 120
    while cluster.health()[1]["stages"]["prefill-1"]["state"] != "ready":  # 8 at once > 2 per replica
        assert time.monotonic() < deadline, cluster.health()
        answers += asyncio.run(burst())
    started = cluster.health()[1]["stages"]["prefill-1"]
    assert "scaler.started_here" in (cluster.workdir / "prefill-b.log").read_text()  # by prefill-b's launcher
    answers += asyncio.run(burst())
    served = cluster.wait(lambda status, body: body["stages"]["prefill-1"].get("stats", {})
                          .get("kv_sent_bytes@kv-shuttle", 0) > 0, "prefill-1 to have served", 30)
    assert served["stages"]["prefill-1"]["pid"] == started["pid"]
    cluster.wait(lambda status, body: body["stages"]["prefill-1"]["state"] == "parked", "prefill-1 to be parked", 60)
    deadline = time.monotonic() + 10  # its host's launcher stops its process
    while Path(f"/proc/{started['pid']}").exists():
        assert time.monotonic() < deadline, "prefill-1's process outlived its parking"
        time.sleep(0.2)
    assert answers == [reference] * len(answers)
    assert cluster.launchers["prefill-b"].poll() is None


def test_a_stage_killed_on_its_host_is_restarted_there_and_announced(cluster, reference):
    _, body = cluster.health()
    pid = body["stages"]["decode-0"]["pid"]
    cluster.net.run("decode-a", ["kill", "-9", str(pid)])
    cluster.wait(lambda status, body: status == 200 and body["stages"]["decode-0"]["restarts"] >= 1
                 and body["stages"]["decode-0"]["pid"] != pid, "decode-0 to be restarted on decode-a")
    assert ask(cluster) == [reference, reference]
    assert cluster.launchers["decode-a"].poll() is None  # the host's launcher itself lives on


def test_a_host_going_away_is_a_dead_replica_until_it_comes_back(cluster, reference):
    cluster.stop("decode-b")
    cluster.wait(lambda status, body: "decode-1" in body.get("down", []), "decode-1 to be declared down", 30)
    assert ask(cluster) == [reference, reference]  # both on decode-0, the host that is left
    cluster.start("decode-b")
    cluster.wait(lambda status, body: status == 200, "decode-b's replica to be back")
    assert ask(cluster) == [reference, reference]
