"""Where stage processes come from: a fork server that has imported what stages import (Linux),
else ``spawn``. The launcher starts its replicas from it, and a Ray actor its one stage."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdflow.plugins import stage_kinds

if TYPE_CHECKING:
    from pdflow.config.pipeline import Pipeline

# What every stage imports. Each kind's own module comes on top (a computing stage's imports torch:
# 2 s of CPU, measured with ps), so that its processes start without paying for it again.
_PRELOAD = ("pdflow.runtime.process",)


def kinds_on(pipeline: Pipeline, host: str) -> list[str | type]:
    """The kinds of the stages with a replica on ``host`` (a name of its ``[hosts]``; "" in a
    one-host pipeline without them)."""
    return [pipeline.stages[name].kind_name for name in dict.fromkeys(name for name, _ in pipeline.replicas(host))]


def stage_processes(main: bool = True,
                    kinds: Iterable[str | type] | None = None) -> multiprocessing.context.BaseContext:
    """Where stage processes come from: a fork server (Linux) that has imported what stages of
    ``kinds`` import (every built-in kind's, where None), else ``spawn``. A host or an actor that
    runs no computing stage (ingress, egress) thus never imports torch. The fork server is
    single-threaded and has run no OpenMP region, so each child starts its own thread pools; it
    exits once the launcher and its children have. Its imports are fixed when it starts: the
    first call in a process that starts one decides them.
    ``$PDFLOW_STAGE_START=spawn`` spawns them instead (to compare: experiments/bench_startup.py).
    ``main``: the fork server imports this process's ``__main__`` too (a stage class defined
    there); not where that is another program's (a Ray worker's: importing it costs each stage
    about 1.2 s of CPU)."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or os.environ.get("PDFLOW_STAGE_START") == "spawn":
        return multiprocessing.get_context("spawn")
    modules = {stage_kinds.module_of(kind) for kind in (stage_kinds.builtin if kinds is None else kinds)}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*(["__main__"] if main else []), *_PRELOAD,
                                    *sorted(module for module in modules if module not in (None, "__main__"))])
    return context


def prepare_stage_processes(kinds: Iterable[str | type] | None = None) -> None:
    """Start the fork server for stages of ``kinds`` now (its imports take seconds), while the
    caller derives keys and finds the model."""
    if stage_processes(kinds=kinds).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
