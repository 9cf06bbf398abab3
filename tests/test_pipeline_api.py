"""The pipeline as data, stage kinds and routers by registry, the request table, and a stage
driven on an in-memory bus with no processes."""

from __future__ import annotations

import asyncio
import pickle
import sys
from pathlib import Path

import pytest

from pdflow import Pipeline, PipelineError, Stage
from pdflow.config.checks import check_pipeline
from pdflow.config.topology import TopologyError, parse_topology
from pdflow.messages import (
    ALL_MESSAGES,
    Cancel,
    Message,
    PrefillRequest,
    RequestFailed,
    Route,
    SamplingParams,
    TextDelta,
    with_plugins,
)
from pdflow.routing import ReplicaStatus, RoutingRequest, create
from pdflow.routing import registry as routers
from pdflow.runtime.kinds import message_types
from pdflow.runtime.memory_bus import MemoryHub
from pdflow.runtime.requests import RequestTable, TableLimits
from pdflow.runtime.stage import StageContext
from pdflow.stages import registry as stages

REPO = Path(__file__).parents[1]


# --- building and checking ----------------------------------------------------------------------


def test_with_stage_splices_into_an_output_and_survives_pickling():
    p = Pipeline.default().with_egress().with_stage("redact", "pdflow.stages.egress:EgressStage", after="egress",
                                                    output="text")
    assert p.stages["prefill"].outputs == p.stages["decode"].outputs == {"tokens": "egress"}
    assert p.stages["egress"].outputs == {"text": "redact"}
    assert p.stages["redact"].outputs == {"text": "ingress"}
    assert p.stages["redact"].port not in {s.port for n, s in p.stages.items() if n != "redact"}
    assert list(p.stages)[-1] == "redact"
    check_pipeline(p)
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(PipelineError, match="no output 'txt'"):
        Pipeline.default().with_egress().with_stage("x", "pdflow.stages.egress:EgressStage", after="egress",
                                                    output="txt")


def test_an_egress_stage_takes_the_tokens_only_where_wired_to():
    """By default ingress detokenizes (no egress stage); ``with_egress`` and a TOML
    ``[stages.egress]`` send the token producers' tokens to one, keeping any output written."""
    assert "egress" not in Pipeline.default().stages and "egress" not in Pipeline.default("colocated").stages
    colocated = Pipeline.default("colocated").with_egress()
    check_pipeline(colocated)
    assert colocated.stages["worker"].outputs == {"tokens": "egress"}
    assert colocated.stages["egress"].outputs == colocated.stages["ingress"].outputs == {"stop": "worker"}
    p = parse_topology('[stages.egress]\n[stages.prefill]\noutputs = { tokens = "ingress" }\n', Path("t.toml"))
    assert p.stages["prefill"].outputs == {"tokens": "ingress"} and p.stages["decode"].outputs == {"tokens": "egress"}
    unused = '[stages.egress]\n' + "".join(f'[stages.{n}]\noutputs = {{ tokens = "ingress" }}\n'
                                             for n in ("prefill", "decode"))
    with pytest.raises(TopologyError) as e:
        parse_topology(unused, Path("t.toml"))
    assert e.value.key == "stages.egress" and "no stage sends it tokens" in e.value.message


def test_the_token_producers_the_checks_do_not_import_have_a_tokens_output():
    """The checks take a built-in producer's "tokens" to an egress stage as the pipeline's own
    wiring without loading its class (pdflow.config.checks._own_wiring): sound only while each has
    that output."""
    from pdflow.config.pipeline import TOKEN_PRODUCERS
    from pdflow.plugins import stage_kinds

    for mode, producers in TOKEN_PRODUCERS.items():
        for name in producers:
            assert "tokens" in stage_kinds.load(name).outputs, (mode, name)


def test_the_kv_traits_the_checks_know_without_importing_are_the_classes():
    """pdflow.plugins.BUILTIN_KV_TRAITS stands for the built-in classes' computes_kv and holds_kv
    (so that a multi-host launcher's checks need not import the stages): each must say what its
    class says."""
    from pdflow.plugins import BUILTIN_KV_TRAITS, stage_kinds

    for name in stage_kinds.builtin:
        for trait, kinds in BUILTIN_KV_TRAITS.items():
            assert bool(getattr(stage_kinds.load(name), trait, False)) == (name in kinds), (name, trait)


def test_a_kinds_module_is_known_without_importing_it():
    from pdflow.plugins import stage_kinds

    assert stage_kinds.module_of("prefill") == "pdflow.stages.prefill"
    assert stage_kinds.module_of("mypkg.redact:RedactStage") == "mypkg.redact"
    assert stage_kinds.module_of(Stage) == "pdflow.runtime.stage"
    assert stage_kinds.module_of("no-such-kind") is None
    assert "mypkg.redact" not in sys.modules


def test_a_fork_server_imports_only_its_hosts_stage_kinds():
    """A host whose stages compute nothing (multi-host.toml's head: ingress) forks them from a
    fork server that never imported torch (about 1.8 s of CPU and 200 MiB saved on such a host, and
    in each Ray actor of ingress or egress); prefill's host preloads prefill's module, torch with it."""
    import subprocess

    code = """if True:
        import sys
        from multiprocessing import forkserver
        from pdflow.config.topology import load_topology
        from pdflow.runtime.stage_start import kinds_on, stage_processes
        topology = load_topology(sys.argv[1])
        child = stage_processes(kinds=kinds_on(topology, "head")).Process(
            target=exec, args=("import sys; sys.exit(3 if 'torch' in sys.modules else 0)",))
        child.start()
        child.join()
        print(kinds_on(topology, "head"), child.exitcode)
        stage_processes(kinds=kinds_on(topology, "prefill-1"))  # (the running fork server keeps its imports)
        print(kinds_on(topology, "prefill-1"), forkserver._forkserver._preload_modules)
    """
    topology = Path(__file__).parent.parent / "topologies" / "multi-host.toml"
    result = subprocess.run([sys.executable, "-c", code, str(topology)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    head, prefill_host = result.stdout.splitlines()
    assert head == "['ingress'] 0"
    assert prefill_host == ("['prefill', 'kv_shuttle'] "
                            "['__main__', 'pdflow.runtime.process', 'pdflow.stages.kv_shuttle', 'pdflow.stages.prefill']")


def test_checks_name_the_key_in_code_and_file_line_key_in_toml(tmp_path):
    bad = Pipeline.default().with_egress().with_stage_config("egress", outputs={"text": "nowhere"})
    with pytest.raises(PipelineError) as e:
        check_pipeline(bad)
    assert e.value.key == "stages.egress.outputs.text" and "'nowhere'" in str(e.value)
    with pytest.raises(PipelineError, match="router.policy"):
        check_pipeline(Pipeline.default().with_router("no_such_router"))
    text = "\n".join(["[stages.redact]", 'kind = "no.such.module:Stage"', "[router]", 'policy = "least_loaded"'])
    with pytest.raises(TopologyError) as e:
        parse_topology(text + "\n", tmp_path / "t.toml")
    assert (e.value.line, e.value.key) == (2, "stages.redact.kind") and "cannot be imported" in e.value.message


def test_toml_stage_of_another_kind_with_rewired_outputs(tmp_path):
    text = """
[router]
policy = "power_of_two"
options = { seed = 7 }
[stages.egress]
outputs = { text = "redact" }
[stages.redact]
kind = "pdflow.stages.egress:EgressStage"
outputs = { text = "ingress" }
options = { words = ["x"] }
"""
    p = parse_topology(text, tmp_path / "t.toml")
    assert p.stages["redact"].kind == "pdflow.stages.egress:EgressStage"
    assert p.stages["redact"].options == {"words": ["x"]} and p.stages["redact"].port == 5570
    assert (p.router.policy, p.router.options) == ("power_of_two", {"seed": 7})


def test_plugin_messages_join_the_decoders():
    class Moderation(Message):
        request_id: str
        verdict: str

    types = with_plugins((Moderation,))
    assert types[: len(ALL_MESSAGES)] == ALL_MESSAGES and types[-1] is Moderation
    with pytest.raises(TypeError, match="reuses the tag"):
        with_plugins((type("Cancel", (Message,), {"__annotations__": {"x": int}}),))


def test_stage_and_router_from_entry_points(tmp_path, monkeypatch):
    """A third-party package's stage and router, found through real entry points."""
    (tmp_path / "thirdparty.py").write_text(
        "from pdflow import Stage, Router\n"
        "class Gate(Stage):\n    kind = 'gate'\n"
        "class First(Router):\n    def pick(self, stage, request, replicas):\n        return replicas[0].replica\n"
    )
    dist = tmp_path / "thirdparty-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pdflow.stages]\ngate = thirdparty:Gate\n\n"
                                           "[pdflow.routers]\nfirst = thirdparty:First\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stages.refresh()
    routers.refresh()
    try:
        assert "gate" in stages.names() and stages.load("gate").kind == "gate"
        router = create("first")
        assert router.route("decode", RoutingRequest("r", [1]), [ReplicaStatus(0, False), ReplicaStatus(1)]) == 1
        p = Pipeline.default().with_stage("g", "gate").with_router("first")
        check_pipeline(p)
    finally:
        sys.modules.pop("thirdparty", None)
        stages.refresh()
        routers.refresh()


# --- routers ---------------------------------------------------------------------------------------


def test_builtin_routers():
    request = RoutingRequest("r", [1, 2, 3])
    replicas = [ReplicaStatus(0, in_flight=5), ReplicaStatus(1, healthy=False), ReplicaStatus(2, assigned=1)]
    rr = create("round_robin")
    assert [rr.route("decode", request, replicas) for _ in range(4)] == [0, 2, 0, 2]  # 1 is down
    assert create("least_loaded").route("decode", request, replicas) == 2
    p2 = create("power_of_two", {"seed": 1})
    assert {p2.route("decode", request, replicas) for _ in range(20)} == {2}  # of 0 and 2, 2 is lighter
    with pytest.raises(TypeError, match="power_of_two"):
        create("power_of_two", {"bogus": 1})


# --- the request table ------------------------------------------------------------------------------


def test_request_table_holds_early_drops_late_and_forgets():
    table: RequestTable = RequestTable(TableLimits(max_early=3, early_ttl_s=10, ended_ttl_s=10))
    table.hold("a", "a1")
    table.hold("a", "a2")
    table.hold("b", "b1")
    table.hold("c", "c1")  # over the bound: a's messages make room
    assert table.take_early("a") == [] and table.take_early("b") == ["b1"]
    table.open("c", object())
    assert table.take_early("c") == ["c1"]
    table.end("c")
    assert table.is_over("c") and "c" not in table
    with pytest.raises(ValueError):
        table.open("c", object())  # an ended request does not reopen
    table.hold("d", "d1")
    table.expire(now=10**12)
    assert table.sizes() == {"active": 0, "early": 0, "ended": 0}


# --- one stage on an in-memory bus -------------------------------------------------------------------


class _Echo(Stage):
    """Opens on a TextDelta with text 'open', echoes later ones to ingress, raises on 'boom'."""

    kind = "echo"
    opens = (TextDelta,)

    def handlers(self):
        return {TextDelta: self.on_text}

    async def on_text(self, delta: TextDelta) -> None:
        if delta.text == "boom":
            raise RuntimeError("boom")
        if delta.text == "open":
            self.requests.open(delta.request_id, {"route": Route()})
            return
        await self.bus.send("ingress", 0, delta)


async def test_stage_on_a_memory_bus_fails_a_request_whose_handler_raises(tmp_path):
    pipeline = Pipeline.default().with_stage("echo", _Echo)
    hub = MemoryHub({"ingress": 1, "echo": 1}, message_types(pipeline))
    stage = _Echo(StageContext(pipeline, "echo", 0, tmp_path), hub.bus("echo"))
    ingress = hub.bus("ingress")
    table = stage.handlers()
    await stage.deliver(TextDelta("r1", "open", 0), table)
    await stage.deliver(TextDelta("r1", "hi", 1), table)
    assert await asyncio.wait_for(ingress.recv(), 1) == TextDelta("r1", "hi", 1)
    await stage.deliver(TextDelta("r1", "boom", 2), table)
    failed = await asyncio.wait_for(ingress.recv(), 1)
    assert isinstance(failed, RequestFailed) and failed.request_id == "r1" and "RuntimeError('boom')" in failed.message
    assert stage.requests.sizes()["active"] == 0 and stage.requests.is_over("r1")
    await stage.deliver(TextDelta("r1", "late", 3), table)  # dropped: the request is over
    await stage.deliver(Cancel("r2"), table)  # a cancel for a request it never saw...
    await stage.deliver(TextDelta("r2", "open", 0), table)  # ...keeps it from opening later
    assert "r2" not in stage.requests and hub.inbox("ingress", 0).empty()


class _Routed(Stage):
    """Opens on a PrefillRequest (from ingress, with the request's route); echoes TextDeltas."""

    kind = "routed"
    opens = (PrefillRequest,)

    def handlers(self):
        return {PrefillRequest: self.on_open, TextDelta: self.on_text}

    def on_open(self, request: PrefillRequest) -> None:
        self.requests.open(request.request_id, request)  # a PrefillRequest carries its route

    async def on_text(self, delta: TextDelta) -> None:
        await self.bus.send("ingress", 0, delta)


async def test_only_replicas_on_a_request_s_route_may_act_on_it(tmp_path):
    """Where the bus names senders, a message about a request is taken only from a replica on its
    route (an opening message: on the route it carries); ingress alone may cancel a request not
    open here yet; messages that came early are checked when it opens."""
    pipeline = Pipeline.default().with_stage("routed", _Routed).with_stage_config("decode", outputs={"tokens": "routed"})
    hub = MemoryHub({"ingress": 1, "routed": 1, "decode": 2}, message_types(pipeline))
    stage = _Routed(StageContext(pipeline, "routed", 0, tmp_path), hub.bus("routed"))
    ingress = hub.bus("ingress")
    table = stage.handlers()
    route = Route({"ingress": 0, "routed": 0, "decode": 1, "egress": 0})
    assert stage.upstream == {"decode"}  # the one stage wired to it
    sampling = SamplingParams(max_tokens=4)

    await stage.deliver(TextDelta("r1", "early, from decode-1", 0), table, ("decode", 1))
    await stage.deliver(TextDelta("r1", "early, from decode-0", 0), table, ("decode", 0))
    await stage.deliver(PrefillRequest("r1", [1, 2], sampling, route), table, ("egress", 0))  # not on its route
    assert "r1" not in stage.requests and stage.forged.count == 1
    await stage.deliver(PrefillRequest("r1", [1, 2], sampling, route), table, ("ingress", 0))
    assert "r1" in stage.requests
    assert await asyncio.wait_for(ingress.recv(), 1) == TextDelta("r1", "early, from decode-1", 0)
    assert stage.forged.count == 2 and hub.inbox("ingress", 0).empty()  # decode-0's was dropped

    await stage.deliver(TextDelta("r1", "from decode-1", 1), table, ("decode", 1))
    await stage.deliver(TextDelta("r1", "from decode-0", 1), table, ("decode", 0))
    assert await asyncio.wait_for(ingress.recv(), 1) == TextDelta("r1", "from decode-1", 1)
    assert stage.forged.count == 3 and hub.inbox("ingress", 0).empty()

    await stage.deliver(TextDelta("r1", "from egress-0", 2), table, ("egress", 0))  # on the route, not wired here
    assert stage.forged.count == 4 and hub.inbox("ingress", 0).empty()

    await stage.deliver(Cancel("r1", "forged"), table, ("decode", 1))  # on the route and wired, not ingress
    await stage.deliver(Cancel("r9", "forged"), table, ("decode", 1))  # not known: only ingress may
    assert "r1" in stage.requests and not stage.requests.is_over("r9") and stage.forged.count == 6
    await stage.deliver(Cancel("r1", "client gone"), table, ("ingress", 0))
    assert "r1" not in stage.requests and stage.requests.is_over("r1")
