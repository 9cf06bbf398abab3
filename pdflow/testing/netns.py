"""Machines on one machine: Linux network namespaces joined by veth pairs to a bridge, with the
link of each shaped by ``tc`` (bandwidth with ``tbf``; latency with ``netem`` where the kernel
has it), so that pdflow's stages run on real, separate addresses and talk over a real (emulated)
network. Needs root and iproute2; :func:`unavailable` says why not where they are missing.

    with Namespaces(["head", "gpu1"], bandwidth="10gbit") as net:
        net.address("gpu1")          # "10.77.0.2"
        proc = net.popen("gpu1", [".venv/bin/pdflow", "run", "topology.toml", "--node", "gpu1"])

Every namespace, veth and bridge carries a prefix unique to the instance (and its process id),
and all are removed on exit, also after an error; processes started with :meth:`popen` are
killed first.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["Namespaces", "unavailable"]

_SUBNET = "10.77.0.0/24"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """None when namespaces can be made here, else why not (for a test's skip reason)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"pdfp-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """Whether this kernel has tc's netem (delay); some minimal kernels ship without it."""
    probe = f"pdfn-{os.getpid()}"
    if _ip("link", "add", probe, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        done = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True, timeout=30)
        return done.returncode == 0
    finally:
        _ip("link", "del", probe, check=False)


class Namespaces:
    """Namespaces named ``names`` on one bridge, each with an address of ``subnet`` (in order:
    .1, .2, ...); this namespace reaches them from the subnet's last address (:attr:`outside`). ``bandwidth`` (tc's units: ``"10gbit"``, ``"500mbit"``) and ``latency`` (``"1ms"``)
    shape what each namespace sends; latency needs netem (:func:`has_netem`, else ValueError)."""

    def __init__(self, names: Sequence[str], bandwidth: str | None = None, latency: str | None = None,
                 subnet: str = _SUBNET) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"expected distinct namespace names, got {list(names)}")
        self.names = list(names)
        self.bandwidth, self.latency = bandwidth, latency
        network = ipaddress.ip_network(subnet)
        hosts = list(network.hosts())
        if len(hosts) < len(self.names) + 1:
            raise ValueError(f"subnet {subnet} has too few addresses for {len(self.names)} namespaces")
        self._addresses = {name: str(address) for name, address in zip(self.names, hosts)}
        self.outside = str(hosts[-1])  # this (the root) namespace's address on the bridge
        self._prefix_len = network.prefixlen
        tag = uuid.uuid4().hex[:4]
        self._tag = f"pd{tag}"  # interface names are at most 15 characters
        self._netns = {name: f"pdflow-{tag}-{i}" for i, name in enumerate(self.names)}
        self._bridge = f"{self._tag}br"
        self._processes: list[subprocess.Popen] = []
        self._made: list[tuple[str, ...]] = []  # what to delete, in reverse

    # --- life -------------------------------------------------------------------------------

    def __enter__(self) -> Namespaces:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _create(self) -> None:
        if self.latency and not has_netem():
            raise ValueError("latency shaping needs tc's netem, which this kernel does not have")
        _ip("link", "add", self._bridge, "type", "bridge")
        self._made.append(("link", "del", self._bridge))
        _ip("addr", "add", f"{self.outside}/{self._prefix_len}", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, name in enumerate(self.names):
            ns, outside, inside = self._netns[name], f"{self._tag}h{i}", f"{self._tag}n{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self._made.append(("link", "del", outside))
            _ip("link", "set", outside, "master", self._bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "link", "set", inside, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self._addresses[name]}/{self._prefix_len}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns)

    def _shape(self, ns: str) -> None:
        if not self.bandwidth and not self.latency:
            return
        if self.latency:
            rule = ["netem", "delay", self.latency] + (["rate", self.bandwidth] if self.bandwidth else [])
        else:  # a token bucket: the rate, bursts of 1 ms of it (at least 64 KB), at most 50 ms queued
            rule = ["tbf", "rate", self.bandwidth, "burst", "256kb", "latency", "50ms"]
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *rule],
                       capture_output=True, text=True, check=True, timeout=30)

    def close(self) -> None:
        for proc in self._processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        while self._made:
            _ip(*self._made.pop(), check=False)

    # --- use --------------------------------------------------------------------------------

    def address(self, name: str) -> str:
        return self._addresses[name]

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self._netns[name], *argv]

    def run(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(name, argv), **kwargs)

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``argv`` started in namespace ``name``, in a process group of its own (killed on exit)."""
        proc = subprocess.Popen(self.command(name, argv), start_new_session=True, **kwargs)
        self._processes.append(proc)
        return proc
