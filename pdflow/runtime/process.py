"""The one entry point of every stage process (forked by the launcher's fork server, or ``spawn``).

The launcher hands each process the pipeline description itself (pickled), not a
path to re-read: a pipeline built in code runs as processes just like one from a topology file.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import select
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.config.pipeline import Pipeline
    from pdflow.security.keys import StageKeys

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class StageLaunch:
    pipeline: Pipeline
    stage: str
    replica: int
    model_dir: str
    log_format: str = "console"
    log_level: str = "info"
    keys: StageKeys | None = None  # this replica's (None: the pipeline runs without authentication)
    launcher_pid: int | None = None  # forked by the launcher's fork server: the launcher to die with

    @property
    def bus_keys(self) -> StageKeys | None:
        return self.keys if self.pipeline.security.authenticate else None


def _die_with_parent(launcher_pid: int | None) -> None:
    """Linux: the kernel kills us when our parent dies, so no stage is ever orphaned. A stage
    forked by the launcher's fork server has that server as its parent, which outlives the
    launcher while any stage lives: such a stage also watches the launcher itself (a pidfd,
    readable once it exits) and dies with it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
    if launcher_pid is None or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # the launcher is already gone
        os._exit(1)
    except OSError:
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _pin(cores: tuple[int, ...]) -> None:
    """Pin the stage to ``cores`` (all it may use where none are named) and size torch's thread
    pool to them. torch reads OMP_NUM_THREADS when it starts, so a stage that never imports it
    (ingress, egress) does not pay for the import here."""
    if cores:
        os.sched_setaffinity(0, cores)
    threads = len(cores) if cores else len(os.sched_getaffinity(0))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def main(launch: StageLaunch) -> None:
    _die_with_parent(launch.launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the stage installs its own handlers
    from pdflow.log import configure_logging

    topology = launch.pipeline
    config = topology.stages[launch.stage]
    title = f"pdflow::{config.display_name}-{launch.replica}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    configure_logging(launch.log_format, launch.log_level, stage=config.display_name, replica=launch.replica)
    import structlog

    log = structlog.get_logger()
    try:
        _pin(config.cores)
        import uvloop

        from pdflow.runtime.bus import ZmqBus
        from pdflow.runtime.kinds import stage_class
        from pdflow.runtime.stage import StageContext

        ctx = StageContext(topology, launch.stage, launch.replica, Path(launch.model_dir))
        bus = ZmqBus(topology, launch.stage, launch.replica, keys=launch.bus_keys)
        stage = stage_class(topology, launch.stage)(ctx, bus)
        stage.keys = launch.keys
        uvloop.run(_serve(stage))
    except Exception as exc:
        log.error("stage.crashed", error=repr(exc), traceback=traceback.format_exc())
        _report_failure(topology, launch, traceback.format_exc())
        _exit(1)
    log.info("stage.exited")
    _exit(0)


async def _serve(stage) -> None:
    # SIGINT stays ignored: a terminal's Ctrl-C reaches the whole process group, and the
    # launcher turns it into SIGTERMs in the right order (ingress drains first)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stage.request_stop)
    await stage.run()


def _exit(status: int) -> None:
    """Leave without the interpreter's teardown of torch and friends, which takes seconds; the
    stage has already closed its sockets and transports."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _report_failure(topology, launch: StageLaunch, error: str) -> None:
    """Tell the launcher why we die (best effort: the launcher also sees the exit code)."""
    import zmq

    from pdflow.messages import StageFailed
    from pdflow.runtime.bus import client_security, launcher_framing, make_socket
    from pdflow.security.keys import LAUNCHER

    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.PUSH, connect=topology.control.pull_address, linger_ms=1000,
                           secure=client_security(launch.bus_keys, LAUNCHER))
        sock.send(launcher_framing().encode(StageFailed(launch.stage, launch.replica, error)))
        sock.close()
    finally:
        ctx.term()
