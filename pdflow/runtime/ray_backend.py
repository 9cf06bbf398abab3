"""The Ray backend: `pdflow run topology.toml --backend ray` runs every stage replica as a Ray actor
on the node the topology places it on, so a Ray cluster deploys pdflow as it deploys vLLM.

The launcher (the driver) stays what it is on one machine: it binds the control endpoints,
waits for every replica's Ready, watches heartbeats, announces deaths and restarts (with its
backoff and ``max_restarts``); only the replicas' processes come from Ray. Each replica is one
actor (:class:`StageActor`) that starts the stage in a process of its own, exactly as the local
launcher would, and exits with it; :class:`RayReplica` gives the launcher the actor through the
same few methods a ``multiprocessing.Process`` has. A replica whose node dies shows as an actor
that died: the launcher starts a new actor, which Ray places on a live node that offers the
host's resource (or waits until one does).

Placement: a host ``NAME`` of the topology's ``[hosts]`` is the Ray node(s) that offer a
custom resource named ``NAME`` (``ray start --resources '{"NAME": 1}'``); each replica placed
on it asks for a sliver of that resource (and no CPU of Ray's accounting: a stage's ``cores``
pin it within the node). Without ``[hosts]``, Ray places the replicas where it likes, which on
a one-node cluster is the only node (their addresses are the stages' ``host``). The nodes reach
each other at the hosts' ``address`` as with ``--node`` (docs/design.md, "Several hosts").

Each actor resolves the model on its own node (pulling it into that node's cache if missing),
and takes its replica's keys as an argument, which Ray keeps in its object store within the
cluster. pdflow (the same version) must be installed on every node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

__all__ = ["RayReplica", "StageActor", "connect", "unavailable"]

_SLIVER = 0.001  # of a host's resource, per replica: thousands fit on a node that offers 1
NAMESPACE = "pdflow"  # the Ray namespace of the driver and its actors


def unavailable() -> str | None:
    """None when Ray can be imported, else what to install."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "the Ray backend needs Ray: pip install 'pdflow[ray]' (or pip install ray)"
    return None


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one ``ray start`` made here or
    ``$RAY_ADDRESS`` names; None: the same, else a cluster of this machine alone), in the Ray
    namespace ``pdflow``, where the replicas' actors are named."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True,
             configure_logging=False)


class StageActor:
    """One stage replica on a Ray node: its stage process, and ways to watch and stop it."""

    def __init__(self, launch: Any) -> None:
        from pdflow.models import resolve
        from pdflow.runtime.stage_start import stage_processes
        from pdflow.runtime.process import main as stage_main

        model = launch.pipeline.model
        model_dir = str(resolve(str(model.path or model.source), progress=False))
        launch = dataclasses.replace(launch, model_dir=model_dir)
        name = f"pdflow::{launch.pipeline.stages[launch.stage].display_name}-{launch.replica}"
        # (not spawned: a spawned child imports the actor's __main__, Ray's worker, before the stage)
        processes = stage_processes(main=False, kinds=[launch.pipeline.stages[launch.stage].kind_name])
        self.process = processes.Process(target=stage_main, args=(launch,), name=name, daemon=True)
        self.process.start()

    def pid(self) -> int:
        return self.process.pid

    def node(self) -> str:
        """The id of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def wait(self) -> int:
        """The stage's exit status, once it exits."""
        while self.process.is_alive():
            await asyncio.sleep(0.1)
        return self.process.exitcode

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()


class RayReplica:
    """A stage replica's actor, as the launcher sees a process: ``start``, ``is_alive``,
    ``exitcode``, ``pid``, ``terminate``, ``kill``, ``join``."""

    def __init__(self, launch: Any, name: str, host: str = "") -> None:
        self.launch, self.name, self.host = launch, name, host
        self.actor = None
        self.exitcode: int | None = None
        self._exit = self._pid_ref = None
        self._pid: int | None = None

    def start(self) -> None:
        import ray

        # named "decode-0@1a2b3c": which replica (`ray list actors` shows it), unique per start
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 4,
                                   "name": f"{self.name}@{uuid.uuid4().hex[:6]}"}
        if self.host:
            options["resources"] = {self.host: _SLIVER}
        self.actor = ray.remote(StageActor).options(**options).remote(self.launch)
        self._exit = self.actor.wait.remote()
        self._pid_ref = self.actor.pid.remote()

    @property
    def pid(self) -> int | None:
        """The stage process's pid on its node, once the actor has said (None until then)."""
        import ray

        if self._pid is None and self._pid_ref is not None:
            done, _ = ray.wait([self._pid_ref], timeout=0)
            if done:
                try:
                    self._pid = ray.get(done[0])
                except Exception:  # the actor died first
                    self._pid_ref = None
        return self._pid

    def is_alive(self) -> bool:
        import ray

        if self.exitcode is not None:
            return False
        done, _ = ray.wait([self._exit], timeout=0)
        if not done:
            return True
        try:
            self.exitcode = ray.get(done[0])
        except Exception:  # the actor died (its node went away, or it was killed): as SIGKILL
            self.exitcode = -9
        ray.kill(self.actor, no_restart=True)  # its stage is gone: so is it (the launcher starts a new one)
        return False

    def terminate(self) -> None:
        if self.actor is not None and self.is_alive():
            self.actor.terminate.remote()

    def kill(self) -> None:
        import ray

        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        import ray

        if self._exit is not None:
            ray.wait([self._exit], timeout=timeout)
        self.is_alive()
