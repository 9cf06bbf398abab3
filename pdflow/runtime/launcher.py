"""Starts every stage replica as its own process, waits until all are ready, watches them, restarts
the ones that die, and stops the whole tree cleanly on SIGINT/SIGTERM.

Supervision: a replica is dead when its process exits or when no heartbeat came for
``heartbeat_timeout_s`` (then it is killed). Every stage hears ``StageDown`` at once, so ingress
migrates (or fails) the requests that replica held; the replica is restarted (up to
``max_restarts`` times) and ``StageUp`` follows when it is ready again.

Several hosts (the topology's ``[hosts]``): ``pdflow run topology.toml --node NAME`` on each
machine starts the replicas placed there. The launcher on ``control.on``'s host supervises the
pipeline as above, for every replica: each one, wherever it runs, reports to its endpoints. A
host's own launcher starts, restarts and stops its replicas (only it can), tells the supervising
one when one of their processes exits (:class:`~pdflow.messages.ReplicaExited`), and kills one
that the supervisor declared dead for its silence. A host that goes away altogether is seen as
its replicas' silence: they are announced down, their requests migrate, and they are back when
they say Ready again.

The launcher holds the pipeline's keys (:mod:`pdflow.security`) and hands each replica its own
through the spawn pipe. What arrives on its PULL is taken only from the replica it says it is
from (as CURVE proved it); anything else, or anything that does not decode, is dropped and counted.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import zmq
import zmq.asyncio

from pdflow.config.checks import check_pipeline
from pdflow.config.pipeline import Pipeline
from pdflow.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    ProtocolMismatch,
    ProtocolRefused,
    Ready,
    ReplicaExited,
    StageDown,
    StageFailed,
    StageStatus,
    StageUp,
)
from pdflow.runtime.bus import (
    FROM_LAUNCHER,
    DropCounter,
    Framing,
    client_security,
    launcher_framing,
    make_socket,
    sender_identity,
    server_security,
)
from pdflow.runtime.process import StageLaunch
from pdflow.runtime.process import main as stage_main
from pdflow.runtime.scaling import ScalingLauncher
from pdflow.runtime.stage_start import kinds_on, stage_processes
from pdflow.security.curve import PipelineAuthenticator
from pdflow.security.keys import LAUNCHER, PipelineKeys, pipeline_keys

log = structlog.get_logger()
_TICK_S = 0.1
_STATUS_EVERY_S = 1.0


@dataclass(slots=True, eq=False)
class _Replica:
    stage: str
    replica: int
    local: bool = True  # its process is this launcher's (else another host's launcher runs it)
    host: str = ""  # the pipeline's host it runs on ("" in a one-host pipeline)
    process: multiprocessing.process.BaseProcess | None = None
    pid: int = 0  # as its Ready said
    ready: bool = False
    down: bool = False  # announced down (StageDown), not back yet (StageUp)
    last_seen: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    in_flight: int = 0
    heard_at: float = 0.0  # its latest heartbeat
    parked: bool = False  # a scaled stage's slot with no process (pdflow.runtime.scaling)
    joining: bool = False  # started by the scaler, not ready yet
    draining_since: float | None = None  # the scaler stops it once it holds no request
    stats: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    heartbeat: int = -1  # the seq of the last heartbeat heard
    started_at: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[str, int]:
        return self.stage, self.replica


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


# libgomp spins this many times at a barrier before it sleeps on a futex. Its default drops to 1000
# spins once a process has more OpenMP threads than cores (a stage's asyncio and I/O threads share
# them), and each of a decode step's ~150 parallel regions then pays for futex wake-ups: a SmolLM2
# decode step in the colocated worker took 16.0 ms at the default, 14.9 ms with this (bare: ~13 ms).
# A user's own GOMP_SPINCOUNT wins.
OPENMP_SPIN = ("GOMP_SPINCOUNT", "300000")


class HostError(ValueError):
    """``--node`` does not fit the topology (no such host, or one needed and not given)."""


def this_host(topology: Pipeline, host: str | None) -> str:
    """The name of the machine a launcher runs on: ``host`` (``--node``), checked, or the only one
    a pipeline uses; "" in a one-host pipeline without ``[hosts]``."""
    hosts = topology.hosts
    if not hosts:
        if host:
            raise HostError(f"--node {host}: the topology has no [hosts] tables, so it runs on this machine alone")
        return ""
    if host is None:
        if topology.multi_host:
            used = sorted({topology.host_name_of(*r) for r in topology.replicas()} | {topology.control.on})
            raise HostError(f"the topology places replicas on hosts {', '.join(used)}: start each with "
                            "`pdflow run TOPOLOGY --node NAME` on that machine")
        return topology.control.on
    if host not in hosts:
        raise HostError(f"--node {host}: no such host in the topology; its hosts are {', '.join(hosts)}")
    if host != topology.control.on and not topology.replicas(host):
        raise HostError(f"--node {host}: the topology places no replica there, and the launcher that supervises "
                        f"runs on {topology.control.on} (control.on)")
    return host


BACKENDS = ("process", "ray")


class Launcher(ScalingLauncher):
    """``backend``: "process" (replicas are processes of this machine: those ``host`` names, or
    all in a one-host pipeline) or "ray" (every replica is a Ray actor on the node its host
    names: :mod:`pdflow.runtime.ray_backend`; this launcher supervises them all)."""

    def __init__(self, topology: Pipeline, model_dir: Path, log_format: str = "console", log_level: str = "info",
                 keys: PipelineKeys | None = None, host: str | None = None, backend: str = "process"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.topology, self.model_dir = topology, model_dir
        self.keys = keys if keys is not None else pipeline_keys(topology)
        self.authenticate = topology.security.authenticate
        self.log_format, self.log_level = log_format, log_level
        self.backend = backend
        if backend == "ray":
            if host is not None:
                raise HostError("--node is for the process backend; with Ray, the driver places every replica")
            self.host = topology.control.on
        else:
            self.host = this_host(topology, host)
        self.supervising = self.host == topology.control.on  # "" == "" on one host
        watched = topology.replicas() if self.supervising else topology.replicas(self.host)
        mine = (lambda key: True) if backend == "ray" else (lambda key: topology.host_name_of(*key) == self.host)
        self.replicas = {key: _Replica(*key, local=mine(key), host=topology.host_name_of(*key)) for key in watched}
        self.mp = stage_processes(kinds=kinds_on(topology, self.host))
        self._park_spare_slots()
        self.stop_requested = asyncio.Event()
        self.fatal: str | None = None  # why the pipeline cannot run (a protocol mismatch): stop now
        self._encode = Framing(FROM_LAUNCHER).encode
        self._framing = launcher_framing()
        self.malformed = DropCounter("launcher.message.malformed")
        self.forged = DropCounter("launcher.message.forged")

    def _name(self, rep: _Replica) -> str:
        return f"{self.topology.stages[rep.stage].display_name}-{rep.replica}"

    @property
    def local(self) -> list[_Replica]:
        return [rep for rep in self.replicas.values() if rep.local]

    def _start(self, rep: _Replica) -> None:
        launch = StageLaunch(self.topology, rep.stage, rep.replica, str(self.model_dir),
                             self.log_format, self.log_level, self.keys.for_replica(rep.stage, rep.replica),
                             launcher_pid=os.getpid() if self.backend == "process" else None)
        os.environ.setdefault(*OPENMP_SPIN)  # the stage inherits it, and its libgomp reads it at load
        if self.backend == "ray":
            from pdflow.runtime.ray_backend import RayReplica

            rep.process = RayReplica(launch, self._name(rep), rep.host)
        else:
            rep.process = self.mp.Process(target=stage_main, args=(launch,), name=self._name(rep), daemon=True)
        rep.process.start()
        rep.ready, rep.restart_at = False, None
        rep.started_at = rep.last_seen = time.monotonic()
        log.info("stage.started", stage=self._name(rep), pid=rep.process.pid)

    def _warn_ephemeral_ports(self) -> None:
        """A stage port inside the kernel's ephemeral range can be taken, while the stage is down,
        by a peer's reconnecting socket (TCP self-connect), and the restart then cannot bind it."""
        low, high = ephemeral_port_range()
        ports = [(f"stages.{rep.stage}.port", self.topology.stages[rep.stage].port + rep.replica) for rep in self.local]
        ports += [(f"stages.{rep.stage}.data_port", self.topology.stages[rep.stage].data_port + rep.replica)
                  for rep in self.local if self.topology.stages[rep.stage].data_port is not None]
        risky = [key for key, port in ports if low <= port <= high]
        if risky:
            log.warning("ports.ephemeral", keys=risky, range=f"{low}-{high}",
                        hint="a restarted stage may find its port taken; choose ports below the range")

    async def run(self) -> int:
        self._warn_ephemeral_ports()
        ctx = zmq.asyncio.Context()
        control = self.topology.control
        own = self.keys.launcher() if self.authenticate else None
        authenticator = None
        if own is not None and self.supervising:
            authenticator = PipelineAuthenticator(ctx, own)
            authenticator.start()
        if self.supervising:
            self.pull = make_socket(ctx, zmq.PULL, bind=control.pull_bind_address, secure=server_security(own))
            self.pub = make_socket(ctx, zmq.PUB, bind=control.pub_bind_address, secure=server_security(own))
        else:  # a host's launcher: hears the supervisor, tells it when a process exits
            self.sub = make_socket(ctx, zmq.SUB, connect=control.pub_address, secure=client_security(own, LAUNCHER))
            self.push = make_socket(ctx, zmq.PUSH, connect=control.pull_address, secure=client_security(own, LAUNCHER))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop_requested.set)
        try:
            for rep in self.local:
                if not rep.parked:
                    self._start(rep)
            if not self.supervising:
                return await self._run_host()
            status = await self._supervise() if await self._wait_ready() else 1
            if self.fatal:
                if self.log_format == "json":
                    log.error("launcher.fatal", error=self.fatal)
                else:
                    sys.stderr.write(f"pdflow: {self.fatal}\n")
                return 1
            return status
        finally:
            await self._stop_all()
            if authenticator is not None:
                authenticator.stop()
            ctx.destroy(linger=0)

    # --- messages from the stages ---------------------------------------------------------

    async def _drain_inbox(self, timeout_s: float) -> None:
        """Handle every message that arrives within ``timeout_s`` (then what is already queued)."""
        timeout_ms = timeout_s * 1000
        while await self.pull.poll(timeout_ms):
            received = await self.pull.recv(copy=False)
            timeout_ms = 0
            frame = received.bytes
            sender = sender_identity(received) if self.authenticate else None
            try:
                message = self._framing.decode(frame)
            except ProtocolMismatch:
                self._foreign(frame, sender)
                continue
            except Exception as exc:  # whatever hostile bytes make msgspec raise: this frame only
                self.malformed.drop(bytes=len(frame), error=str(exc)[:200])
                continue
            claimed = (LAUNCHER, 0) if isinstance(message, ReplicaExited) else (message.stage, message.replica)
            if sender is not None and sender != claimed:
                self.forged.drop(message=type(message).__name__, sender=sender,
                                 claimed=(message.stage, message.replica))
                continue
            await self._handle(message)

    def _mismatch(self, stage: str, theirs: int | None) -> None:
        self.fatal = (f"stage {stage} speaks pdflow protocol {theirs}, the launcher speaks {PROTOCOL_VERSION}: "
                      "run the same pdflow version on every stage")
        log.error("launcher.protocol_mismatch", stage=stage, theirs=theirs, ours=PROTOCOL_VERSION, error=self.fatal)
        self.stop_requested.set()

    def _foreign(self, frame: bytes, sender: tuple[str, int] | None = None) -> None:
        """A frame of another protocol version: when it is the Ready of one of our replicas (from
        that replica, where CURVE says who sent it), stop naming it; anything else is junk."""
        ready = Framing.foreign(frame, Ready)
        if ready is None:
            self.malformed.drop(bytes=len(frame), error=f"a frame of pdflow protocol {Framing.version_of(frame)}, "
                                f"not a Ready")
            return
        if (ready.stage, ready.replica) not in self.replicas or sender not in (None, (ready.stage, ready.replica)):
            self.forged.drop(message="Ready", sender=sender, claimed=(ready.stage, ready.replica))
            return
        self._mismatch(f"{ready.stage}-{ready.replica} (pid {ready.pid})", ready.protocol_version)

    async def _handle(self, message) -> None:
        rep = self.replicas.get((message.stage, message.replica))
        if rep is None:
            return
        if isinstance(message, ReplicaExited):
            if not rep.local:
                await self._remote_exit(rep, message)
            return
        rep.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            rep.heard_at = rep.last_seen
            rep.in_flight = message.in_flight
            rep.stats, rep.notes, rep.heartbeat = message.stats, message.notes, message.seq
        elif isinstance(message, ProtocolRefused):
            self.fatal = f"{self._name(rep)} refused a peer: {message.error}"
            log.error("launcher.protocol_mismatch", stage=self._name(rep), error=message.error)
            self.stop_requested.set()
        elif isinstance(message, Ready):
            if message.protocol_version != PROTOCOL_VERSION:
                self._mismatch(self._name(rep), message.protocol_version)
                return
            if rep.ready and not rep.local and message.pid != rep.pid:  # restarted there before it was missed
                await self._announce_down(rep, f"restarted on host {rep.host} (pid {rep.pid} -> {message.pid})")
            rep.ready, rep.pid, rep.joining = True, message.pid, False
            log.info("stage.ready", stage=self._name(rep), pid=message.pid,
                     seconds=round(time.monotonic() - rep.started_at, 2), **({"host": rep.host} if rep.host else {}))
            if rep.down:
                rep.down = False
                await self.pub.send(self._encode(StageUp(rep.stage, rep.replica)))
                self._print_status(f"{self._name(rep)} is back")
        elif isinstance(message, StageFailed):
            log.error("stage.failed", stage=self._name(rep), error=message.error)

    async def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.topology.limits.ready_timeout_s
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            await self._drain_inbox(_TICK_S)
            if all(rep.ready or rep.parked for rep in self.replicas.values()):
                self._print_status("ready")
                return True
            dead = [rep for rep in self.local if rep.process is not None and not rep.process.is_alive()]
            if dead:
                for rep in dead:
                    log.error("stage.start_failed", stage=self._name(rep), exitcode=rep.process.exitcode,
                              hint="its traceback is above")
                return False
        missing = ", ".join(self._name(r) + (f" (on host {r.host})" if not r.local else "")
                            for r in self.replicas.values() if not r.ready and not r.parked)
        if not self.stop_requested.is_set():
            log.error("launcher.ready_timeout", not_ready=missing,
                      timeout_s=self.topology.limits.ready_timeout_s,
                      hint="raise limits.ready_timeout_s or read the stage's log above")
        return False

    # --- supervision ----------------------------------------------------------------------

    async def _supervise(self) -> int:
        limits = self.topology.limits
        next_status = 0.0
        while not self.stop_requested.is_set():
            await self._drain_inbox(_TICK_S)
            now = time.monotonic()
            if now >= next_status:
                await self._publish_status()
                next_status = now + min(_STATUS_EVERY_S, limits.heartbeat_interval_s)
            await self._scale(now)
            for rep in self.replicas.values():
                if rep.parked:
                    continue
                if not rep.local:  # its host's launcher restarts it; here only its silence tells
                    if rep.joining and now - rep.started_at > limits.ready_timeout_s:
                        await self._park(rep, f"not ready {limits.ready_timeout_s:g} s after the scaler started it "
                                         f"(is host {rep.host} up?)")
                    elif rep.ready and now - rep.last_seen > limits.heartbeat_timeout_s:
                        await self._announce_down(rep, f"no heartbeat for {now - rep.last_seen:.1f} s "
                                                  f"(host {rep.host})")
                    continue
                if rep.restart_at is not None:
                    if now >= rep.restart_at:
                        self._start(rep)
                    continue
                if not rep.process.is_alive():
                    reason = self._exit_reason(rep.process.exitcode)
                elif not rep.ready and now - rep.started_at > limits.ready_timeout_s:
                    reason = f"not ready {limits.ready_timeout_s} s after (re)start"
                    rep.process.kill()
                elif rep.ready and now - rep.last_seen > limits.heartbeat_timeout_s:
                    reason = f"no heartbeat for {now - rep.last_seen:.1f} s"
                    rep.process.kill()
                else:
                    continue
                if not await self._on_death(rep, reason):
                    return 1
        return 0

    def _state(self, rep: _Replica) -> str:
        if rep.parked:
            return "parked"
        if rep.ready:
            return "draining" if rep.draining_since is not None else "ready"
        if rep.restart_at or rep.down:
            return "restarting"
        return "joining" if rep.joining else "starting"

    async def _publish_status(self) -> None:
        for rep in self.replicas.values():
            pid = (rep.process.pid if rep.process else rep.pid) or 0  # 0: not known yet (a Ray actor still placed)
            status = StageStatus(rep.stage, rep.replica, self._state(rep), pid, rep.in_flight, rep.restarts,
                                 rep.stats, rep.notes, rep.heartbeat)
            await self.pub.send(self._encode(status))

    @staticmethod
    def _exit_reason(exitcode: int | None) -> str:
        if exitcode is not None and exitcode < 0:
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"exited with status {exitcode}"

    async def _announce_down(self, rep: _Replica, reason: str) -> None:
        """Every stage hears that ``rep`` is dead (ingress migrates what it held)."""
        log.error("stage.died", stage=self._name(rep), reason=reason, restarts=rep.restarts)
        rep.ready, rep.down = False, True
        await self.pub.send(self._encode(StageDown(rep.stage, rep.replica, reason)))

    async def _remote_exit(self, rep: _Replica, message: ReplicaExited) -> None:
        """Another host's launcher saw ``rep``'s process exit (and restarts it, or gave up)."""
        if rep.parked:
            return  # stopped by its launcher because the scaler parked it
        if rep.ready or not rep.down:
            await self._announce_down(rep, f"{message.reason} on host {rep.host}")
        if rep.draining_since is not None:  # the scaler was stopping it anyway (its host hears it is parked)
            await self._park(rep, f"died while draining ({message.reason} on host {rep.host})")
            return
        if message.restarting:
            rep.restarts += 1
            self._print_status(f"{self._name(rep)} died on host {rep.host} ({message.reason}); its host restarts it")
        else:
            log.error("stage.gave_up", stage=self._name(rep), host=rep.host,
                      hint=f"host {rep.host}'s launcher reached limits.max_restarts and stopped its replicas")

    async def _on_death(self, rep: _Replica, reason: str) -> bool:
        name = self._name(rep)
        await self._announce_down(rep, reason)
        if rep.draining_since is not None:  # the scaler was stopping it anyway: its requests migrate
            await self._park(rep, f"died while draining ({reason})")
            return True
        if rep.restarts >= self.topology.limits.max_restarts:
            log.error("stage.gave_up", stage=name, restarts=rep.restarts,
                      hint="limits.max_restarts reached; stopping every stage")
            return False
        delay = min(0.5 * 2**rep.restarts, 5.0)
        rep.restarts += 1
        rep.restart_at = time.monotonic() + delay
        self._print_status(f"{name} died ({reason}); restarting in {delay:.1f} s")
        return True

    # --- a host's launcher (several hosts) ------------------------------------------------

    async def _run_host(self) -> int:
        """Keep this host's replicas running: restart what exits (telling the supervisor), kill
        what the supervisor declared dead for its silence, until stopped or past max_restarts."""
        limits = self.topology.limits
        framing = Framing(FROM_LAUNCHER)
        announced = False
        while not self.stop_requested.is_set():
            if await self.sub.poll(_TICK_S * 1000):
                try:
                    message = framing.decode(await self.sub.recv())
                except Exception as exc:  # another version, or junk: this frame only
                    self.malformed.drop(error=str(exc)[:200])
                    continue
                rep = self.replicas.get((message.stage, message.replica))
                if rep is None:
                    continue
                if isinstance(message, StageStatus):
                    self._follow_scaler(rep, message.state)
                    rep.ready = message.state == "ready" and message.pid == (rep.process.pid if rep.process else 0)
                elif isinstance(message, StageDown) and message.reason.startswith("no heartbeat"):
                    if rep.process is not None and rep.process.is_alive() and \
                            time.monotonic() - rep.started_at > limits.heartbeat_timeout_s:
                        log.error("stage.silent", stage=self._name(rep), hint="the supervisor heard nothing from it; "
                                  "killing it to restart it")
                        rep.process.kill()
            if not announced and all(rep.ready or rep.parked for rep in self.replicas.values()):
                announced = True
                self._print_status(f"host {self.host} ready")
            now = time.monotonic()
            for rep in self.replicas.values():
                if rep.parked:
                    continue
                if rep.restart_at is not None:
                    if now >= rep.restart_at:
                        self._start(rep)
                    continue
                if rep.process.is_alive():
                    continue
                reason = self._exit_reason(rep.process.exitcode)
                restarting = rep.restarts < limits.max_restarts
                log.error("stage.died", stage=self._name(rep), reason=reason, restarts=rep.restarts)
                await self.push.send(launcher_framing().encode(ReplicaExited(rep.stage, rep.replica, reason, restarting)))
                rep.ready = False
                if not restarting:
                    log.error("stage.gave_up", stage=self._name(rep), restarts=rep.restarts,
                              hint="limits.max_restarts reached; stopping this host's stages")
                    return 1
                delay = min(0.5 * 2**rep.restarts, 5.0)
                rep.restarts += 1
                rep.restart_at = now + delay
                self._print_status(f"{self._name(rep)} died ({reason}); restarting in {delay:.1f} s")
        return 0

    # --- stopping -------------------------------------------------------------------------

    async def _stop_all(self) -> None:
        """Ingress first (it drains in-flight requests), then the rest; kill what lingers."""
        grace = self.topology.limits.shutdown_grace_s
        ingress = [r for r in self.local if r.stage == "ingress"]
        others = [r for r in self.local if r.stage != "ingress"]
        await self._terminate(ingress, grace + 2.0)
        await self._terminate(others, 1.5)
        log.info("launcher.stopped")

    async def _terminate(self, reps: list[_Replica], wait_s: float) -> None:
        alive = [r.process for r in reps if r.process is not None and r.process.is_alive()]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + wait_s
        while any(p.is_alive() for p in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in alive:
            if proc.is_alive():
                log.warning("stage.killed", stage=proc.name, hint="did not stop in time")
                proc.kill()
                proc.join(1.0)

    def _api_urls(self) -> list[str]:
        """Where each ingress replica serves the API (one URL per host with server.reuse_port)."""
        server, ingress = self.topology.server, self.topology.stages["ingress"]
        urls = [f"http://{ingress.address_of(i) if server.host in ('0.0.0.0', '::') else server.host}:"
                f"{server.port_of(i)}/v1" for i in range(ingress.replicas)]
        return list(dict.fromkeys(urls))

    def _print_status(self, headline: str) -> None:
        api = ", ".join(self._api_urls())
        hosts = bool(self.topology.hosts)
        if self.log_format == "json":  # one event, as every other line of a JSON log
            log.info("pipeline.status", headline=headline, api=api, replicas=[
                {"replica": self._name(rep), "host": rep.host, "pid": (rep.process.pid if rep.process else rep.pid),
                 "cores": list(self.topology.stages[rep.stage].cores), "device": self.topology.stages[rep.stage].device,
                 "state": self._state(rep), "restarts": rep.restarts} for rep in self.replicas.values()])
            return
        lines = [f"pdflow: {headline} — API at {api}",
                 f"  {'stage':<14}" + (f"{'host':<12}" if hosts else "")
                 + f"{'pid':>8}  {'cores':<10}{'device':<8}{'state':<10}{'restarts':>8}"]
        for rep in self.replicas.values():
            cfg = self.topology.stages[rep.stage]
            pid = (rep.process.pid if rep.process else rep.pid) or "-"
            state = self._state(rep)
            cores = ",".join(map(str, cfg.cores)) or "any"
            lines.append(f"  {self._name(rep):<14}" + (f"{rep.host:<12}" if hosts else "")
                         + f"{pid:>8}  {cores:<10}{cfg.device:<8}{state:<10}{rep.restarts:>8}")
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()


def run(pipeline: Pipeline, *, log_format: str = "console", log_level: str = "info",
        api_key: str | None = None, host: str | None = None, backend: str = "process",
        ray_address: str | None = None) -> int:
    """Run ``pipeline`` as processes (one per stage replica) until SIGINT/SIGTERM; the exit status.

    What ``pdflow run topology.toml`` does, for a pipeline built in code. The pipeline is checked
    first (PipelineError), its secret and API key read (SecretError), and the model is pulled on
    first use. ``api_key``: the key HTTP clients must send (else the topology's, if any);
    ``host``: which of the pipeline's hosts this machine is (``pdflow run --node``; HostError);
    ``backend``: "process", or "ray" (replicas as actors of the Ray cluster at ``ray_address``).
    """
    import uvloop

    from pdflow.log import configure_logging
    from pdflow.models import resolve

    check_pipeline(pipeline)
    if backend == "process":
        this_host(pipeline, host)
    configure_logging(log_format, log_level, stage="launcher")
    keys = pipeline_keys(pipeline, api_key)
    model_dir = resolve(str(pipeline.model.path or pipeline.model.source), progress=sys.stderr.isatty())
    if backend == "ray":
        from pdflow.runtime.ray_backend import connect

        connect(ray_address)
    return uvloop.run(Launcher(pipeline, model_dir, log_format, log_level, keys, host, backend).run())
