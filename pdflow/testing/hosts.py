"""A pipeline over several hosts on one machine: each host a network namespace
(:class:`~pdflow.testing.netns.Namespaces`), each started by its own ``pdflow run topology.toml
--host NAME`` in that namespace, as an operator would on each machine. What the multi-host tests
and ``scripts/experiment_hosts.py`` share.

    with Namespaces(["head", "gpu1"], bandwidth="10gbit") as net:
        cluster = Cluster(net, workdir, lambda secret: topology_text(net, secret))
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

from pdflow.testing.netns import Namespaces

__all__ = ["Cluster", "host_tables"]


def host_tables(net: Namespaces, names: Sequence[str]) -> str:
    """The topology's ``[hosts.NAME]`` tables: each host at its namespace's address, binding every
    address."""
    return "\n".join(f'[hosts.{name}]\naddress = "{net.address(name)}"\nbind = "0.0.0.0"\n' for name in names)


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
        self.launchers[host] = self.net.popen(host, [pdflow, "run", str(self.path), "--host", host],
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
            r = httpx.get(f"{self.url}/health", timeout=5)
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
