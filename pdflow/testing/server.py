"""Start `pdflow run` on free ports in a subprocess: for end-to-end tests, benchmarks and experiments.

Each server's pipeline secret is made here and handed to `pdflow run` in its environment
(``[security] secret_env``), so a test can derive any replica's keys (:meth:`PdflowServer.keys`)
and speak on the control plane as that replica.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from pdflow.runtime.launcher import ephemeral_port_range
from pdflow.testing.local_http import local_http

_PORTS = 11  # server, control (2), five stage control ports, three data ports
SECRET_ENV = "PDFLOW_SECRET"


# Ray starts its workers on ports from 10002 to 19999 (its min_worker_port and max_worker_port)
_LOWEST_PORT = 20000
# The ranges this process handed out lately: a port is free only until its server binds it, and a
# replica the scaler starts later (parked at first) binds it later still, so a second check would
# find it free and hand it out again. (The latest 64: a long sweep of servers must not run out.)
_HANDED_OUT: collections.deque[range] = collections.deque(maxlen=64)


def free_port_base(count: int = _PORTS) -> int:
    """A run of ``count`` free ports below the kernel's ephemeral range: a port inside it can be
    taken, while its stage is down, by a peer's own reconnecting socket (TCP connects to itself
    when its source port happens to equal the port it dials), and the restarted stage could not
    bind it again. None of them overlaps a run this process handed out before, and in a
    pytest-xdist worker each run comes from that worker's own share of the ports (workers start
    servers side by side, each checking ports another's parked replica has not bound yet)."""
    low, high = _LOWEST_PORT, ephemeral_port_range()[0] - count
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker[2:].isdigit() and workers.isdigit() and int(workers) > 1:
        share = (high - low) // int(workers)
        low += int(worker[2:]) * share
        high = low + share - count
    for _ in range(200):
        base = random.randrange(low, high)
        ports = range(base, base + count)
        if any(ports.start < taken.stop and taken.start < ports.stop for taken in _HANDED_OUT):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.append(ports)
        return base
    raise RuntimeError("no free port range found")


def _inline(options: dict | None) -> str:
    if not options:
        return "{}"
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + " }"


def _table(settings: dict | None) -> str:
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in (settings or {}).items())


def topology_text(base: int, transport: str = "tcp", extra: str = "", mode: str = "disaggregated",
                  chunked_prefill_tokens: int = 0, kv_streaming: str = "layer",
                  link_options: dict | None = None, request_timeout_s: float = 120, kv: dict | None = None,
                  server: dict | None = None, egress: bool = False, codec: str = "none",
                  decode_link_options: dict | None = None, decode_codec: str | None = None,
                  decode_codec_options: dict | None = None, heartbeat_timeout_s: float = 10) -> str:
    """A topology on ports ``base`` .. ``base + 10``; ``link_options`` go on the prefill -> kv_shuttle
    link; ``kv`` and ``server``: more settings of the [kv] and [server] tables; ``egress``: an
    egress stage detokenizes (else ingress does); ``codec``: every link's KV codec;
    ``decode_link_options``, ``decode_codec`` (else ``codec``) and ``decode_codec_options``: the
    kv_shuttle -> decode link's."""
    common = f"""
[model]
source = "smollm2"

[server]
port = {base}
{_table(server)}

[control]
port = {base + 1}

[security]
secret_env = "{SECRET_ENV}"

[limits]
max_batch = 32
ready_timeout_s = 240
heartbeat_interval_s = 0.5
heartbeat_timeout_s = {heartbeat_timeout_s}
request_timeout_s = {request_timeout_s}

[kv]
{_table(kv)}

[stages.ingress]
port = {base + 3}
"""
    if egress:
        common += f"""[stages.egress]
port = {base + 7}
"""
    if mode == "colocated":
        return common + f"""
[engine]
mode = "colocated"
chunked_prefill_tokens = {chunked_prefill_tokens}

[stages.worker]
port = {base + 4}
cores = [0, 1]
{extra}
"""
    return common + f"""
[engine]
kv_streaming = "{kv_streaming}"

[stages.prefill]
port = {base + 4}
data_port = {base + 10}
cores = [0]
[stages.kv_shuttle]
port = {base + 5}
data_port = {base + 8}
[stages.decode]
port = {base + 6}
data_port = {base + 9}
cores = [1]

[[links]]
src = "prefill"
dst = "kv_shuttle"
transport = "{transport}"
options = {_inline(link_options)}
codec = "{codec}"

[[links]]
src = "kv_shuttle"
dst = "decode"
transport = "{transport}"
options = {_inline(decode_link_options)}
codec = "{decode_codec or codec}"
codec_options = {_inline(decode_codec_options)}
{extra}
"""


def front_doors_topology(base: int, doors: int = 2, **settings) -> str:
    """:func:`topology_text`'s pipeline (``settings``) with ``doors`` ingress replicas, the API on
    ``base`` .. ``base + doors - 1`` (the control ports that were there move past the rest, out of
    their way): on :data:`FRONT_DOOR_PORTS` ports from ``base``, for up to 2 doors."""
    if not 1 <= doors <= 2:
        raise ValueError("up to 2 front doors fit these ports")
    text = topology_text(base, **settings)
    text = text.replace(f"[control]\nport = {base + 1}\n", f"[control]\nport = {base + 11}\n")
    return text.replace(f"[stages.ingress]\nport = {base + 3}\n",
                        f"[stages.ingress]\nreplicas = {doors}\nport = {base + 13}\n")


FRONT_DOOR_PORTS = 16  # topology_text's 11, then control (2) and ingress's control ports (2) past them


PD_STAGES = ("prefill", "kv_shuttle", "decode")
_CORES = {"prefill": "[0]", "decode": "[1]"}  # as the default topology pins them


def replicated_ports(replicas: dict[str, int]) -> int:
    """The ports :func:`replicated_topology` takes for ``replicas``."""
    return 4 + 2 * sum(replicas.get(stage, 1) for stage in PD_STAGES)


def replicated_topology(replicas: dict[str, int], tables: str = "", *, min_replicas: dict[str, int] | None = None,
                        limits: dict | None = None) -> Callable[[int], str]:
    """A PD topology (tcp links, authenticated planes, prefill on core 0, decode on core 1) with
    ``replicas`` of each of prefill, kv_shuttle and decode (1 where not named), ``min_replicas``
    for the scaler, ``limits`` over the [limits] defaults, and more ``tables`` (e.g. [router],
    [scaler], [kv]): a function of the first of :func:`replicated_ports` free ports, as
    :class:`PdflowServer` takes it."""
    settings = {"max_batch": 32, "ready_timeout_s": 300, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10,
                "request_timeout_s": 120, **(limits or {})}

    def text(base: int) -> str:
        port, stages = base + 4, []
        for stage in PD_STAGES:
            count = replicas.get(stage, 1)
            lines = [f"[stages.{stage}]", f"replicas = {count}", f"port = {port}", f"data_port = {port + count}"]
            if stage in (min_replicas or {}):
                lines.append(f"min_replicas = {min_replicas[stage]}")
            if stage in _CORES:
                lines.append(f"cores = {_CORES[stage]}")
            stages.append("\n".join(lines))
            port += 2 * count
        return f"""
[model]
source = "smollm2"

[server]
port = {base}

[control]
port = {base + 1}

[security]
secret_env = "{SECRET_ENV}"

[limits]
{_table(settings)}

{tables}

[stages.ingress]
port = {base + 3}

{chr(10).join(stages)}

[[links]]
src = "prefill"
dst = "kv_shuttle"
transport = "tcp"

[[links]]
src = "kv_shuttle"
dst = "decode"
transport = "tcp"
"""

    return text


class PdflowServer:
    """``with PdflowServer(tmp) as s:`` runs `pdflow run` until the block ends (SIGTERM)."""

    def __init__(self, workdir: Path, transport: str = "tcp", extra: str = "", startup_timeout_s: float = 240,
                 log_format: str = "console", mode: str = "disaggregated", chunked_prefill_tokens: int = 0,
                 kv_streaming: str = "layer", link_options: dict | None = None, request_timeout_s: float = 120,
                 kv: dict | None = None, api_key: str | None = None, server: dict | None = None,
                 egress: bool = False, codec: str = "none", decode_link_options: dict | None = None,
                 decode_codec: str | None = None, decode_codec_options: dict | None = None,
                 topology: Callable[[int], str] | None = None, ports: int = _PORTS, heartbeat_timeout_s: float = 10,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """``topology(base)``: the topology's text on ports ``base`` .. ``base + ports - 1``
        (its server on ``base``; ``[security] secret_env = SECRET_ENV``), instead of
        :func:`topology_text`'s from the other settings. ``args``: more flags of `pdflow run`
        (``--model ...``); ``env``: more environment variables."""
        from pdflow.security.keys import new_secret

        self.workdir = workdir
        self.secret = new_secret()
        self.api_key = api_key
        base = free_port_base(ports)
        self.base = base
        self.url = f"http://127.0.0.1:{base}"
        self.topology = workdir / "topology.toml"
        self.topology.write_text(
            topology(base) if topology is not None else
            topology_text(base, transport, extra, mode, chunked_prefill_tokens, kv_streaming, link_options,
                          request_timeout_s, kv, server, egress, codec, decode_link_options, decode_codec,
                          decode_codec_options, heartbeat_timeout_s)
        )
        self.log_path = workdir / "pdflow.log"
        self.startup_timeout_s = startup_timeout_s
        self.log_format = log_format
        self.args, self.env = tuple(args), dict(env or {})
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PdflowServer":
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "pdflow.cli", "run", str(self.topology), "--log-format", self.log_format,
               *self.args]
        env = {**os.environ, SECRET_ENV: self.secret.hex(), **self.env}
        env.pop("PDFLOW_API_KEY", None)
        if self.api_key:
            env["PDFLOW_API_KEY"] = self.api_key
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdflow run exited with {self.proc.returncode}:\n{self.log()}")
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"pdflow run not ready in {self.startup_timeout_s} s:\n{self.log()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def pipeline(self):
        from pdflow.config.topology import load_topology

        return load_topology(self.topology)

    def keys(self):
        """Every replica's keys (:class:`~pdflow.security.keys.PipelineKeys`): to speak as one."""
        from pdflow.security.keys import PipelineKeys

        return PipelineKeys(self.secret, self.pipeline().replicas())

    def health(self) -> dict | None:
        try:
            return local_http().get(f"{self.url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None

    def fresh_stats(self, timeout_s: float = 20) -> dict[str, dict]:
        """Every stage's stats (``/health``) from heartbeats sent after this call began: two more
        heartbeats of each replica (the first may have been on its way already), or one of a new
        process; none of a parked one. Past ``timeout_s``, the latest. (``/health`` shows what the launcher last
        published, a heartbeat and a publication behind the stage: read right after a request, it
        can still show the store before it.)"""
        def read() -> dict[str, dict]:
            return (self.health() or {}).get("stages", {})

        base = {name: stage.get("heartbeat", -1) for name, stage in read().items()
                if stage.get("state") != "parked"}  # (no process: no heartbeat to wait for)
        deadline = time.monotonic() + timeout_s
        while True:
            now = read()
            seqs = {name: stage.get("heartbeat", -1) for name, stage in now.items()}
            if all(seqs.get(name, -1) >= seq + 2 or 0 <= seqs.get(name, -1) < seq for name, seq in base.items()) \
                    or time.monotonic() > deadline:
                return {name: stage.get("stats", {}) for name, stage in now.items()}
            time.sleep(0.05)

    def quiet_stats(self, quiet_s: float = 1.5, timeout_s: float = 20) -> dict[str, dict]:
        """Every stage's stats from :meth:`fresh_stats` on, once none has changed for ``quiet_s``
        (three heartbeat intervals of these topologies; the launcher publishes them every
        interval): the counters of work that goes on after an answer is out (a store decoding what
        it keeps, leases let go) have come in with the heartbeats. Past ``timeout_s``, the latest."""
        def read() -> dict[str, dict]:
            body = self.health() or {}
            return {name: stage.get("stats", {}) for name, stage in body.get("stages", {}).items()}

        deadline = time.monotonic() + timeout_s
        last = self.fresh_stats(timeout_s)
        since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = read()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def healthy(self) -> bool:
        body = self.health()
        return bool(body) and body.get("status") == "ok"

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return True
            time.sleep(0.25)
        return False

    def stage_pids(self) -> dict[str, int]:
        body = self.health() or {}
        return {name: info["pid"] for name, info in body.get("stages", {}).items()}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def stop(self, timeout_s: float = 15) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._log.close()


def held(stats: dict) -> dict:
    """What a store's stats say holds memory (leases by holder, leased and used blocks): short
    enough for an assertion message to show whole."""
    keep = ("leases", "leased_blocks", "blocks_used", "blocks_cached", "blocks_quarantined")
    return {name: value for name, value in stats.items() if name in keep or name.startswith("leases_") and value}
