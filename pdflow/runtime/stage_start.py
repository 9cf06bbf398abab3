"""Where stage processes come from: a fork server that has imported what stages import (Linux),
else ``spawn``. The launcher starts its replicas from it, and a Ray actor its one stage."""

from __future__ import annotations

import multiprocessing
import os

# What every stage imports, loaded once by the fork server its processes are forked from: a
# stage then starts without paying for torch and the stages' modules again (2 s of CPU each, measured with ps).
_PRELOAD = ["__main__", "pdflow.runtime.process", "torch", "pdflow.stages.prefill", "pdflow.stages.decode",
            "pdflow.stages.kv_shuttle", "pdflow.stages.worker", "pdflow.stages.ingress"]


def stage_processes(main: bool = True) -> multiprocessing.context.BaseContext:
    """Where stage processes come from: a fork server (Linux) that has imported what stages
    import, else ``spawn``. The fork server is single-threaded and has run no OpenMP region, so
    each child starts its own thread pools; it exits once the launcher and its children have.
    ``$PDFLOW_STAGE_START=spawn`` spawns them instead (to compare: experiments/bench_startup.py).
    ``main``: the fork server imports this process's ``__main__`` too (a stage class defined
    there); not where that is another program's (a Ray worker's: importing it costs each stage
    about 1.2 s of CPU)."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or os.environ.get("PDFLOW_STAGE_START") == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD if main else [name for name in _PRELOAD if name != "__main__"])
    return context


def prepare_stage_processes() -> None:
    """Start the fork server now (its imports take seconds), while the caller derives keys and finds the model."""
    if stage_processes().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
