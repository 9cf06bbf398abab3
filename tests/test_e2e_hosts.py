"""End to end across machines: each stage on a host of its own (a network namespace with its own
address, joined to the others by veth pairs and a bridge, its link shaped by tc), started by
`pdflow run topology.toml --host NAME` in that namespace, as an operator would on each machine.

One pipeline: ingress on `head` (which supervises), prefill, kv-shuttle and two decode replicas
on four more hosts. It answers what the engine answers in-process; a decode process killed on its
host is restarted by that host's launcher; a whole host going away is a dead replica to the
others (its requests go to the other decode) until it comes back. All of it with KV over tcp, and
again over ucx (over its tcp transport between namespaces: UCX's shared memory cannot wake a peer
in another one). Skipped with the reason where namespaces cannot be made (not root, no iproute2)
or the transport is not installed.
"""

from __future__ import annotations


import openai
import pytest

from pdflow import transports
from pdflow.testing.hosts import Cluster, hosts_topology
from pdflow.testing.netns import Namespaces, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

HOSTS = ("head", "prefill", "shuttle", "decode-a", "decode-b")
QUESTION = "What is the capital of France?"


PLACEMENT = {"ingress": ["head"], "prefill": ["prefill"], "kv_shuttle": ["shuttle"],
             "decode": ["decode-a", "decode-b"]}


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def cluster(request, tmp_path_factory):
    problem = transports.availability(request.param)
    if problem:
        pytest.skip(f"transport {request.param!r} is not available here: {problem}")
    with Namespaces(HOSTS, bandwidth="10gbit") as net:
        running = Cluster(net, tmp_path_factory.mktemp("hosts"),
                          lambda secret: hosts_topology(net, secret, PLACEMENT, heartbeat_timeout_s=4,
                                                        transport=request.param))
        running.transport = request.param
        for host in HOSTS:
            running.start(host)
        running.wait(lambda status, body: status == 200, "every stage on every host to be ready")
        yield running


def ask(cluster: Cluster, count: int = 2) -> list[str]:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
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
    sockets = cluster.net.run("shuttle", ["ss", "-tnH"]).stdout
    for host in ("decode-a", "decode-b"):
        assert any(f"{cluster.net.address(host)}:{port}" in sockets for port in (5640, 5641)), sockets


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
