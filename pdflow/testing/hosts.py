"""A pipeline over several hosts on one machine: each host a network namespace
(:class:`~pdflow.testing.netns.Namespaces`), each started by its own ``pdflow run topology.toml
--node NAME`` in that namespace, as an operator would on each machine. What the multi-host tests
and ``experiments/experiment_hosts.py`` share.

    with Namespaces(["head", "gpu1"], bandwidth="10gbit") as net:
        cluster = Cluster(net, workdir, lambda secret: hosts_topology(net, secret, placement))
        for host in net.names:
            cluster.start(host)
        cluster.wait(lambda status, body: status == 200, "every stage to be ready")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from pdflow.testing.local_http import local_http
from pdflow.testing.netns import Namespaces

__all__ = ["Cluster", "hosts_topology"]

_CORES = {"prefill": "[0]", "decode": "[1]"}  # as the default topology pins them


def hosts_topology(net: Namespaces, secret_file: Path, placement: dict[str, Sequence[str]],
                   heartbeat_timeout_s: float = 10, request_timeout_s: float = 120,
                   transports: tuple[str, str] = ("tcp", "tcp"), min_replicas: dict[str, int] | None = None,
                   extra: str = "") -> str:
    """A PD topology over hosts of ``net`` (each at its namespace's address, binding every
    address; ingress on ``head``, which supervises): ``placement`` maps each stage to the hosts of
    its replicas, one each; the planes authenticated with ``secret_file``; KV over ``transports``
    (into kv-shuttle, which its links out of decode and into prefill then use; into decode).
    ``min_replicas``: per stage, for the scaler (its ``[scaler]`` table in ``extra``, TOML
    appended as it is)."""
    hosts = dict.fromkeys(host for on in placement.values() for host in on)
    tables = [f'[hosts.{name}]\naddress = "{net.address(name)}"\nbind = "0.0.0.0"\n' for name in hosts]
    for stage, on in placement.items():
        lines = [f"[stages.{stage}]", f"replicas = {len(on)}",
                 f'on = "{on[0]}"' if len(on) == 1 else "on = [" + ", ".join(f'"{h}"' for h in on) + "]"]
        if stage in _CORES:
            lines.append(f"cores = {_CORES[stage]}")
        if stage in (min_replicas or {}):
            lines.append(f"min_replicas = {min_replicas[stage]}")
        tables.append("\n".join(lines) + "\n")
    for (src, dst), transport in zip((("prefill", "kv_shuttle"), ("kv_shuttle", "decode")), transports):
        tables.append(f'[[links]]\nsrc = "{src}"\ndst = "{dst}"\ntransport = "{transport}"\n')
    body = "\n".join(tables)
    return f"""
[model]
source = "smollm2"

[server]
host = "0.0.0.0"

[security]
secret_file = "{secret_file}"

[control]
on = "head"

[limits]
ready_timeout_s = 300
heartbeat_timeout_s = {heartbeat_timeout_s}
request_timeout_s = {request_timeout_s}

{body}
{extra}"""


class Cluster:
    """The launchers of one pipeline, one per host. ``topology(secret_file)``: the topology's
    text (its ``[security]`` names the pipeline's secret file, written here); ingress's HTTP port
    ``port`` on host ``head``."""

    def __init__(self, net: Namespaces, workdir: Path, topology: Callable[[Path], str], head: str = "head",
                 port: int = 8000) -> None:
        from pdflow.security.keys import new_secret, write_secret_file

        self.net, self.workdir = net, workdir
        secret = workdir / "pipeline.key"
        write_secret_file(secret, new_secret())
        self.path = workdir / "topology.toml"
        self.path.write_text(topology(secret))
        self.launchers: dict[str, subprocess.Popen] = {}
        self.url = f"http://{net.address(head)}:{port}"

    def start(self, host: str) -> None:
        log = open(self.workdir / f"{host}.log", "ab")
        pdflow = str(Path(sys.executable).parent / "pdflow")
        self.launchers[host] = self.net.popen(host, [pdflow, "run", str(self.path), "--node", host],
                                              stdout=log, stderr=subprocess.STDOUT)

    def stop(self, host: str) -> None:
        """The host goes away: its launcher and stages killed at once, nothing said to anyone."""
        proc = self.launchers.pop(host)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.workdir.glob("*.log"))

    def health(self) -> tuple[int, dict]:
        try:
            r = local_http().get(f"{self.url}/health", timeout=5)
            return r.status_code, r.json()
        except (httpx.HTTPError, ValueError):
            return 0, {}

    def wait(self, predicate: Callable[[int, dict], bool], what: str, timeout_s: float = 300) -> dict:
        """``/health``'s body once ``predicate(status, body)`` holds; RuntimeError (with the hosts'
        logs) if a launcher exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = self.health()
            if predicate(status, body):
                return body
            for host, proc in self.launchers.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the launcher of {host} exited with {proc.returncode} while waiting for "
                                       f"{what}\n{self.logs()}")
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}; last /health: {self.health()}\n{self.logs()}")
