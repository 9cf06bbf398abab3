"""End to end on a Ray cluster: `pdflow run topology.toml --backend ray` against a real
three-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head and two more nodes,
each a raylet of its own offering a custom resource named after a topology host). Every replica is
a Ray actor on the node its host names; the pipeline answers what the engine answers in-process;
a stage process killed on its node is restarted through Ray (a new actor, on the same host's
node); the scaler starts decode's second replica as an actor under a burst and ends it when
quiet; a whole node going away is a dead replica until a node offering its host's resource joins,
where its replica then starts again. Skipped where Ray is not installed (pip install 'pdflow[ray]').
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdflow.testing.local_http import local_http, openai_client
from pdflow.testing.server import SECRET_ENV, free_port_base
from pdflow.top import Scrape

# (Ray is imported where it is used: importing it took each test worker 0.4 s of CPU at collection)
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="the Ray backend's tests need Ray (pip install 'pdflow[ray]')")]

QUESTION = "What is the capital of France?"
PLACEMENT = {"ingress": "head", "prefill": "prefill-node", "kv_shuttle": "prefill-node", "decode": "decode-node"}
PLACED = sorted([("ingress-0", "head"), ("prefill-0", "prefill-node"), ("kv-shuttle-0", "prefill-node"),
                 ("decode-0", "decode-node")])


# decode-1 is the scaler's: parked until decode's batch holds more than 2 sequences for half a
# second (a burst's 8 requests overlap in decode's batch only as long as prefill hands them over
# faster than decode ends them: on a loaded machine, not by much); parked again once it held none
# for 1.5 s
SCALER = """[scaler]
interval_s = 0.25
window_s = 3
decode_queue_per_replica = 2
prefill_queue_per_replica = 100
tbt_slo_ms = 60000
ttft_slo_ms = 60000
up_after_s = 0.5
down_after_s = 1.5
cooldown_s = 1
"""


def topology(base: int) -> str:
    hosts = "\n".join(f'[hosts.{name}]\naddress = "127.0.0.1"\n' for name in dict.fromkeys(PLACEMENT.values()))
    return f"""
[model]
source = "smollm2"

[server]
port = {base}

[security]
secret_env = "{SECRET_ENV}"

[control]
on = "head"
port = {base + 1}

[limits]
ready_timeout_s = 300
request_timeout_s = 120

{hosts}
[stages.ingress]
on = "head"
port = {base + 3}

[stages.prefill]
on = "prefill-node"
port = {base + 4}
data_port = {base + 7}
cores = [0]

[stages.kv_shuttle]
on = "prefill-node"
port = {base + 5}
data_port = {base + 8}

[stages.decode]
on = "decode-node"
replicas = 2
min_replicas = 1
port = {base + 10}
data_port = {base + 12}
cores = [1]

{SCALER}"""


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # (the head without a dashboard, an autoscaler monitor or a log monitor: nothing here reads them,
    # and their processes took 1.5-2 s of CPU to start)
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                         "include_dashboard": False, "no_monitor": True,
                                                         "include_log_monitor": False})
    made.hosts = {host: made.add_node(num_cpus=1, resources={host: 1}) for host in ("prefill-node", "decode-node")}
    made.wait_for_nodes()
    ray.init(address=made.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


@pytest.fixture(scope="module")
def pipeline(cluster, tmp_path_factory):
    from pdflow.security.keys import encode_secret, new_secret

    workdir = tmp_path_factory.mktemp("ray")
    base = free_port_base(14)
    path = workdir / "topology.toml"
    path.write_text(topology(base))
    log = open(workdir / "launcher.log", "wb")
    env = {**os.environ, SECRET_ENV: encode_secret(new_secret())}
    pdflow = str(Path(sys.executable).parent / "pdflow")
    proc = subprocess.Popen([pdflow, "run", str(path), "--backend", "ray", "--ray-address", cluster.address],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{base}"
    try:
        wait_healthy(url, proc, workdir, lambda body: True)
        yield url, proc, workdir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen, workdir: Path, also, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"pdflow run exited with {proc.returncode}:\n{(workdir / 'launcher.log').read_text()[-5000:]}")
        try:
            r = local_http().get(f"{url}/health", timeout=5)
            if r.status_code == 200 and also(r.json()):
                return r.json()
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"not healthy in {timeout_s} s:\n{(workdir / 'launcher.log').read_text()[-5000:]}")


def ask(url: str) -> str:
    client = openai_client(url, timeout=120)
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=12).choices[0].message.content


@pytest.fixture(scope="module")
def reference(served_model):
    from pdflow.testing.reference import chat_ids, greedy_answer

    loaded, tokenizer = served_model
    return greedy_answer(loaded, tokenizer, chat_ids(tokenizer, QUESTION), 12)


def placed_actors() -> list[tuple[str, str]]:
    """(replica, host resource of its node) for each live pdflow actor (the replica: the actor's
    name without the start's suffix), as Ray's nodes and the actors themselves say."""
    import ray

    from pdflow.runtime.ray_backend import NAMESPACE

    resources_of = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    placed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        try:
            node = ray.get(ray.get_actor(entry["name"], namespace=NAMESPACE).node.remote(), timeout=30)
        except (ValueError, ray.exceptions.RayActorError):  # it ended after the listing: not live
            continue
        hosts = [name for name in resources_of[node] if name in PLACEMENT.values()]
        placed.append((entry["name"].split("@")[0], hosts[0] if hosts else "?"))
    return sorted(placed)


def test_every_replica_is_an_actor_on_its_hosts_node_and_the_pipeline_answers(pipeline, reference):
    url, _, _ = pipeline
    assert ask(url) == reference
    assert placed_actors() == PLACED


def test_a_stage_killed_on_its_node_is_restarted_through_ray(pipeline, reference):
    url, proc, workdir = pipeline
    pid = local_http().get(f"{url}/health", timeout=5).json()["stages"]["decode-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_healthy(url, proc, workdir, lambda body: body["stages"]["decode-0"]["restarts"] >= 1
                 and body["stages"]["decode-0"]["pid"] != pid)
    assert ask(url) == reference
    assert placed_actors() == PLACED  # the new actor on decode's node, the old one gone


def test_the_scaler_starts_an_actor_and_parks_it(pipeline):
    url, proc, workdir = pipeline

    def decode_1() -> dict:
        return local_http().get(f"{url}/health", timeout=5).json()["stages"]["decode-1"]

    async def burst() -> list[str]:  # a client per loop: asyncio.run makes a new one each time
        async with openai_client(url, asynchronous=True, timeout=120) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40,
                extra_body={"ignore_eos": True}) for _ in range(8)))
        return [r.choices[0].message.content for r in replies]

    def steps_of_decode_1() -> float:
        return Scrape.parse(local_http().get(f"{url}/metrics", timeout=10).text, 0).value(
            "pdflow_decode_steps_total", stage="decode", replica="1")

    assert decode_1()["state"] == "parked"
    alone = openai_client(url, timeout=120).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40,
        extra_body={"ignore_eos": True}).choices[0].message.content

    def keep_busy(stop: threading.Event) -> None:
        """One answer after another until ``stop``: decode's batch is never empty for long, so the
        scaler keeps decode-1 once it is ready (it parks a ready replica after 1.5 s with no
        request at all; a joining one it never parks)."""
        client = openai_client(url, timeout=120)
        while not stop.is_set():
            client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=200, extra_body={"ignore_eos": True})

    answers = []
    deadline = time.monotonic() + 120
    while decode_1()["state"] == "parked":  # 8 at once: decode's batch > 2 per replica
        assert time.monotonic() < deadline, decode_1()
        answers += asyncio.run(burst())
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        keeper = pool.submit(keep_busy, stop)
        try:
            # its actor starts a fresh interpreter that loads the model: seconds, a minute on a
            # loaded machine (bursts meanwhile would only take the CPU it needs)
            deadline = time.monotonic() + 240
            while decode_1()["state"] != "ready":
                assert time.monotonic() < deadline, decode_1()
                assert not keeper.done(), keeper.exception()
                time.sleep(0.5)
            assert placed_actors() == sorted(PLACED + [("decode-1", "decode-node")])
            answers += asyncio.run(burst())
            deadline = time.monotonic() + 10  # its counters come with its heartbeat
            while not steps_of_decode_1():
                assert time.monotonic() < deadline, "decode-1 never decoded"
                time.sleep(0.2)
        finally:
            stop.set()
        keeper.result(timeout=120)
    wait_healthy(url, proc, workdir, lambda body: body["stages"]["decode-1"]["state"] == "parked", 60)
    deadline = time.monotonic() + 30  # its actor ends with its process
    while placed_actors() != PLACED:
        assert time.monotonic() < deadline, placed_actors()
        time.sleep(0.5)
    assert answers == [alone] * len(answers)


def test_a_node_going_away_is_a_dead_replica_until_a_node_for_its_host_joins(cluster, pipeline, reference):
    """The decode node's raylet dies with its actors: decode-0 is declared down (ingress refuses
    with 503 at once, rather than hanging), its new actor waits for a node offering
    ``decode-node``, and once one joins the replica starts there and the pipeline answers again."""
    url, proc, workdir = pipeline
    pid = local_http().get(f"{url}/health", timeout=5).json()["stages"]["decode-0"]["pid"]
    cluster.remove_node(cluster.hosts.pop("decode-node"), allow_graceful=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = local_http().get(f"{url}/health", timeout=5).json()
        if "decode-0" in body.get("down", []):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"decode-0 was not declared down after its node went away: {body}")
    refused = local_http().post(f"{url}/v1/completions", timeout=30,
                                json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2})
    assert refused.status_code == 503 and "decode" in refused.text, (refused.status_code, refused.text)
    cluster.hosts["decode-node"] = cluster.add_node(num_cpus=1, resources={"decode-node": 1})
    wait_healthy(url, proc, workdir, lambda body: body["stages"]["decode-0"]["pid"] not in (None, 0, pid)
                 and "decode-0" not in body.get("down", []))
    assert ask(url) == reference
    assert placed_actors() == PLACED
