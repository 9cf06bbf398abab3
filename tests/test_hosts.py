"""Several hosts in a topology: [hosts], stages placed with `on`, bind and advertised addresses,
the checks that keep a pipeline on several machines authenticated and on transports that cross
them, and which replicas `pdflow run --node NAME` starts. (Transports advertising an address
other than the one they bind: the transport conformance suite.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdflow.config.topology import TopologyError, load_topology, parse_topology
from pdflow.runtime.launcher import HostError, this_host

HOSTS = ['[hosts.head]', 'address = "10.0.0.1"', 'bind = "0.0.0.0"',
         '[hosts.gpu1]', 'address = "10.0.0.2"',
         '[hosts.gpu2]', 'address = "10.0.0.3"', 'bind = "0.0.0.0"']
SECRET = ['[security]', 'secret_env = "PDFLOW_SECRET"']
PLACED = ['[stages.prefill]', 'on = "gpu1"', '[stages.kv_shuttle]', 'on = "gpu1"',
          '[stages.decode]', 'replicas = 2', 'on = ["gpu1", "gpu2"]']


def parse(*lines: str):
    return parse_topology("\n".join(lines) + "\n", Path("topo.toml"))


def test_stages_placed_on_hosts_bind_there_and_advertise_the_host_address() -> None:
    t = parse(*SECRET, *HOSTS, *PLACED)
    assert list(t.hosts) == ["head", "gpu1", "gpu2"] and t.multi_host
    # the launcher supervises from the first host; stages without `on` run there too
    assert (t.control.on, t.control.pull_address, t.control.pull_bind_address) == (
        "head", "tcp://10.0.0.1:5500", "tcp://0.0.0.0:5500")
    ingress, decode = t.stages["ingress"], t.stages["decode"]
    assert (ingress.control_address(0), ingress.control_bind_address(0)) == ("tcp://10.0.0.1:5510", "tcp://0.0.0.0:5510")
    assert [decode.control_address(i) for i in (0, 1)] == ["tcp://10.0.0.2:5540", "tcp://10.0.0.3:5541"]
    assert [decode.control_bind_address(i) for i in (0, 1)] == ["tcp://10.0.0.2:5540", "tcp://0.0.0.0:5541"]
    assert [t.host_name_of("decode", i) for i in (0, 1)] == ["gpu1", "gpu2"]
    assert t.replicas("gpu1") == [("prefill", 0), ("kv_shuttle", 0), ("decode", 0)]
    assert t.replicas("gpu2") == [("decode", 1)] and t.replicas("head") == [("ingress", 0)]


def test_one_host_named_is_not_several() -> None:
    t = parse('[hosts.only]', 'address = "192.168.1.5"', '[stages.decode]', 'replicas = 2')
    assert not t.multi_host and t.control.on == "only"
    assert t.stages["decode"].control_address(1) == "tcp://192.168.1.5:5541"
    assert this_host(t, None) == "only"  # `pdflow run` without --node runs it all


def test_same_ports_on_different_hosts_do_not_clash_but_on_one_host_they_do() -> None:
    parse(*SECRET, *HOSTS, '[stages.prefill]', 'on = "gpu1"', 'port = 7000',
          '[stages.decode]', 'on = "gpu2"', 'port = 7000')
    with pytest.raises(TopologyError) as caught:
        parse(*SECRET, *HOSTS, '[stages.prefill]', 'on = "gpu1"', 'port = 7000',
              '[stages.decode]', 'on = "gpu1"', 'port = 7000')
    assert "port 7000" in caught.value.message


BAD = [
    ("on without hosts", ['[stages.decode]', 'on = "gpu1"'], "stages.decode.on", "no [hosts] tables"),
    ("unknown host", [*SECRET, *HOSTS, '[stages.decode]', 'on = "gpu3"'], "stages.decode.on",
     "no host named 'gpu3'; did you mean 'gpu2'?"),
    ("one host per replica", [*SECRET, *HOSTS, '[stages.decode]', 'replicas = 3', 'on = ["gpu1", "gpu2"]'],
     "stages.decode.on", "one per replica (3), got 2"),
    ("stage host with hosts", [*SECRET, *HOSTS, '[stages.decode]', 'host = "10.0.0.9"'], "stages.decode.host",
     "place it with stages.decode.on"),
    ("control host with hosts", [*SECRET, *HOSTS, '[control]', 'host = "10.0.0.9"'], "control.host",
     "set control.on"),
    ("host without address", ['[hosts.gpu1]', 'bind = "0.0.0.0"'], "hosts.gpu1", "missing key 'address'"),
    ("wildcard address", ['[hosts.gpu1]', 'address = "0.0.0.0"'], "hosts.gpu1.address",
     "not an address other machines can reach"),
    ("bad host name", ['[hosts."gpu 1"]', 'address = "10.0.0.2"'], 'hosts.gpu 1', "letters, digits"),
    ("several hosts without a shared secret", [*HOSTS, *PLACED], "security", "must share one secret"),
    ("several hosts unauthenticated", ['[security]', 'authenticate = false', *HOSTS, *PLACED],
     "security.authenticate", "refuses that unauthenticated"),
    ("shm between hosts", [*SECRET, *HOSTS, *PLACED, '[[links]]', 'src = "kv_shuttle"', 'dst = "decode"',
                           'transport = "shm"', '[[links]]', 'src = "prefill"', 'dst = "kv_shuttle"',
                           'transport = "shm"'],
     "links[0].transport", "shares memory on one machine"),
]


@pytest.mark.parametrize(("lines", "key", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_placement_names_the_key(tmp_path: Path, lines: list[str], key: str, fragment: str) -> None:
    file = tmp_path / "topology.toml"
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(TopologyError) as caught:
        load_topology(file)
    assert caught.value.key == key, str(caught.value)
    assert fragment in caught.value.message, str(caught.value)


def test_which_replicas_a_launcher_runs() -> None:
    t = parse(*SECRET, *HOSTS, *PLACED)
    assert this_host(t, "gpu2") == "gpu2"
    with pytest.raises(HostError, match="start each with `pdflow run TOPOLOGY --node NAME`"):
        this_host(t, None)
    with pytest.raises(HostError, match="no such host"):
        this_host(t, "gpu9")
    with pytest.raises(HostError, match="no \\[hosts\\] tables"):
        this_host(parse(), "gpu1")
    lonely = parse(*SECRET, *HOSTS, '[hosts.spare]', 'address = "10.0.0.9"', *PLACED)
    with pytest.raises(HostError, match="places no replica there"):
        this_host(lonely, "spare")


def test_a_host_launcher_watches_its_own_replicas_and_the_supervisor_all(tmp_path: Path) -> None:
    from pdflow.runtime.launcher import Launcher

    t = parse(*SECRET, *HOSTS, *PLACED)
    member = Launcher(t, tmp_path, keys=_keys(t), host="gpu2")
    assert not member.supervising and list(member.replicas) == [("decode", 1)]
    head = Launcher(t, tmp_path, keys=_keys(t), host="head")
    assert head.supervising and len(head.replicas) == 5
    assert [rep.key for rep in head.local] == [("ingress", 0)]


def _keys(t):
    from pdflow.security.keys import PipelineKeys, new_secret

    return PipelineKeys(new_secret(), t.replicas())


def test_with_host_keeps_what_it_cannot_readdress() -> None:
    from pdflow.transports.base import with_host

    assert with_host("tcp://0.0.0.0:5640", "10.0.0.2") == "tcp://10.0.0.2:5640"
    assert with_host("ucx://[::]:7000", "fd00::2") == "ucx://[fd00::2]:7000"
    assert with_host("shm://@pdflow-5640", "10.0.0.2") == "shm://@pdflow-5640"


class _Pub:
    """What the supervising launcher publishes, decoded."""

    def __init__(self):
        from pdflow.runtime.bus import FROM_LAUNCHER, Framing

        self.framing, self.sent = Framing(FROM_LAUNCHER), []

    async def send(self, frame: bytes) -> None:
        self.sent.append(self.framing.decode(frame))


async def test_the_supervisor_announces_a_remote_replica_down_and_up(tmp_path: Path) -> None:
    from pdflow.messages import PROTOCOL_VERSION, Ready, ReplicaExited, StageDown, StageUp
    from pdflow.runtime.launcher import Launcher

    t = parse(*SECRET, *HOSTS, *PLACED)
    head = Launcher(t, tmp_path, keys=_keys(t), host="head")
    head.pub = _Pub()
    head._print_status = lambda headline: None
    await head._handle(Ready("decode", 1, 100, PROTOCOL_VERSION))
    assert head.replicas[("decode", 1)].ready and head.pub.sent == []
    # its host's launcher saw the process exit and restarts it: down now, up at its next Ready
    await head._handle(ReplicaExited("decode", 1, "killed by SIGKILL", True))
    await head._handle(Ready("decode", 1, 101, PROTOCOL_VERSION))
    assert [type(m) for m in head.pub.sent] == [StageDown, StageUp]
    assert "killed by SIGKILL on host gpu2" in head.pub.sent[0].reason
    assert head.replicas[("decode", 1)].restarts == 1
    # restarted there before anyone missed it: a Ready under another pid is a death and a return
    head.pub.sent.clear()
    await head._handle(Ready("decode", 1, 102, PROTOCOL_VERSION))
    assert [type(m) for m in head.pub.sent] == [StageDown, StageUp]
    assert "restarted on host gpu2 (pid 101 -> 102)" in head.pub.sent[0].reason
    # the same Ready again (a duplicate frame) changes nothing
    head.pub.sent.clear()
    await head._handle(Ready("decode", 1, 102, PROTOCOL_VERSION))
    assert head.pub.sent == []


def test_a_replica_exit_report_is_taken_from_a_launcher_only(tmp_path: Path, monkeypatch) -> None:
    """ReplicaExited must come from the launcher identity (another host's launcher); a stage
    replica that sends one in its own name is a forgery, dropped and counted."""
    import asyncio
    from types import SimpleNamespace

    from pdflow.messages import ReplicaExited
    from pdflow.runtime import launcher as launcher_module
    from pdflow.runtime.bus import launcher_framing
    from pdflow.runtime.launcher import Launcher

    t = parse(*SECRET, *HOSTS, *PLACED)
    head = Launcher(t, tmp_path, keys=_keys(t), host="head")
    head.pub = _Pub()
    head._print_status = lambda headline: None
    head.replicas[("decode", 1)].ready = True
    frame = SimpleNamespace(bytes=launcher_framing().encode(ReplicaExited("decode", 1, "exited with status 1", True)))

    class Inbox:
        def __init__(self):
            self.frames = [frame]

        async def poll(self, timeout_ms):
            return bool(self.frames)

        async def recv(self, copy=False):
            return self.frames.pop(0)

    for sender in (("decode", 1), ("launcher", 0)):  # as CURVE named the peer that sent it
        head.pull = Inbox()
        monkeypatch.setattr(launcher_module, "sender_identity", lambda received, sender=sender: sender)
        asyncio.run(head._drain_inbox(0))
    assert head.forged.count == 1
    assert [m.reason for m in head.pub.sent] == ["exited with status 1 on host gpu2"]
