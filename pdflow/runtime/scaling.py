"""What the launcher does for the adaptive scaler (mixed into :class:`~pdflow.runtime.launcher.Launcher`).

A scaled stage (``min_replicas`` below ``replicas``) has ``replicas`` slots, each with its ports;
``min_replicas`` of them start with the pipeline and the rest are *parked* (no process). Every
``scaler.interval_s`` the policy (:mod:`pdflow.runtime.scaler`) may ask for one more or one fewer:

- **up**: the lowest parked slot starts; it is *joining* until its Ready, and ingress routes to
  it once it is ready;
- **down**: the running replica holding the fewest requests (the highest slot of those) is
  *draining*: ingress routes nothing new to it (it hears the state at once), and once its
  heartbeats say it holds nothing (``_DRAIN_SETTLE_S`` after the drain began, so that a
  request routed just before reaches it first) it gets SIGTERM and is parked. No request is cut:
  one still held after ``limits.request_timeout_s`` is migrated like a dead replica's, and a
  replica that dies while draining is parked, not restarted.

Each change is logged (``scaler.up`` / ``scaler.down`` with the reason) and printed in the status
table; ``GET /metrics`` counts replicas by state.

Several hosts: the supervising launcher decides for every slot, wherever it is placed, and says
so in the ``StageStatus`` it publishes (at once on a change, and every second). A slot on
another host is started and stopped by that host's launcher (:meth:`ScalingLauncher._follow_scaler`),
when the state it hears leaves or becomes ``parked``; heartbeats tell the supervisor when it
drained, as for its own. With ``--backend ray`` every replica is the supervisor's: it starts and
stops the actors itself.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pdflow.runtime.scaler import Load, Scaler, StageLoad

log = structlog.get_logger()
_DRAIN_SETTLE_S = 2.0


class ScalingLauncher:
    scaler: Scaler | None = None
    next_scale_at = 0.0
    reaping: set  # tasks waiting for parked replicas' processes to exit

    def _park_spare_slots(self) -> None:
        """At start: the slots of scaled stages past ``min_replicas`` wait parked."""
        self.reaping = set()
        scaled = {name: cfg for name, cfg in self.topology.stages.items() if cfg.scaled}
        if scaled:
            self.scaler = Scaler(self.topology.scaler)
        for rep in self.replicas.values():
            if rep.stage in scaled and rep.replica >= scaled[rep.stage].floor:
                rep.parked = True

    async def _scale(self, now: float) -> None:
        """Finish drains that are done; every interval, ask the policy and act on its answer."""
        for rep in [r for r in self.replicas.values() if r.draining_since is not None]:
            if rep.in_flight == 0 and rep.heard_at - rep.draining_since > _DRAIN_SETTLE_S:
                await self._park(rep, "drained")
            elif now - rep.draining_since > self.topology.limits.request_timeout_s:
                await self._announce_down(rep, f"still held {rep.in_flight} requests "
                                          f"{self.topology.limits.request_timeout_s:g} s into its drain")
                await self._park(rep, "drain timed out: its requests migrate")
        if self.scaler is None or now < self.next_scale_at:
            return
        self.next_scale_at = now + self.topology.scaler.interval_s
        for stage, (step, why) in self.scaler.decide(self._load(), now).items():
            if step > 0:
                await self._scale_up(stage, why)
            else:
                await self._scale_down(stage, why)

    def _load(self) -> Load:
        stages = {}
        for name, cfg in self.topology.stages.items():
            if not cfg.scaled:
                continue
            live = [r for r in self.replicas.values() if r.stage == name and not r.parked]
            running = [r for r in live if r.draining_since is None]
            stages[name] = StageLoad(cfg.kind_name, len(running), sum(_work(r) for r in running), cfg.floor,
                                     cfg.replicas)
        said = [r.stats for r in self.replicas.values() if r.stage == "ingress"]  # each front door's p90: the worst
        ttft = max((s["ttft_p90_us"] for s in said if "ttft_p90_us" in s), default=None)
        tbt = max((s["tbt_p90_us"] for s in said if "tbt_p90_us" in s), default=None)
        return Load(stages, None if ttft is None else ttft / 1e6, None if tbt is None else tbt / 1e6)

    async def _scale_up(self, stage: str, why: str) -> None:
        parked = sorted((r for r in self.replicas.values() if r.stage == stage and r.parked), key=lambda r: r.replica)
        if not parked:
            return
        rep = parked[0]
        rep.parked, rep.joining = False, True
        if rep.local:
            self._start(rep)
        else:  # its host's launcher starts it on hearing it is no longer parked (published below)
            rep.started_at = time.monotonic()
        log.info("scaler.up", stage=self._name(rep), reason=why)
        self._print_status(f"scaler: {self._name(rep)} starts ({why})")
        await self._publish_status()

    async def _scale_down(self, stage: str, why: str) -> None:
        candidates = [r for r in self.replicas.values()
                      if r.stage == stage and r.ready and not r.parked and r.draining_since is None]
        if len(candidates) <= self.topology.stages[stage].floor:
            return
        rep = min(candidates, key=lambda r: (r.in_flight, -r.replica))
        rep.draining_since = time.monotonic()
        log.info("scaler.down", stage=self._name(rep), reason=why, in_flight=rep.in_flight)
        self._print_status(f"scaler: {self._name(rep)} drains ({why})")
        await self._publish_status()  # ingress stops routing to it now

    async def _park(self, rep, why: str) -> None:
        rep.draining_since, rep.parked, rep.ready, rep.joining, rep.pid = None, True, False, False, 0
        self._stop_process(rep)  # another host's: its launcher stops it on hearing it is parked
        log.info("scaler.parked", stage=self._name(rep), reason=why)
        self._print_status(f"scaler: {self._name(rep)} parked ({why})")
        await self._publish_status()

    def _stop_process(self, rep) -> None:
        """SIGTERM ``rep``'s process if it runs here, and reap it off the supervision loop."""
        process, rep.process, rep.restart_at = rep.process, None, None
        if process is not None and process.is_alive():
            process.terminate()
            task = asyncio.get_running_loop().create_task(_reap(process))
            self.reaping.add(task)
            task.add_done_callback(self.reaping.discard)

    def _follow_scaler(self, rep, state: str) -> None:
        """A host's launcher, on the supervisor's state for one of its slots: start the parked
        slot that the scaler started, stop the running one it parked."""
        if rep.parked and state != "parked":
            rep.parked = False
            self._start(rep)
            log.info("scaler.started_here", stage=self._name(rep), state=state)
        elif not rep.parked and state == "parked":
            rep.parked, rep.ready = True, False
            self._stop_process(rep)
            log.info("scaler.parked_here", stage=self._name(rep))


def _work(rep) -> int:
    """The requests a replica is working on: for decode, its batch (its requests in flight also
    count those still in prefill, whose KV has not come: more decode replicas would not help
    them); for prefill, all it holds (its queue)."""
    return rep.stats.get("batch_size", rep.in_flight)


async def _reap(process, grace_s: float = 5.0) -> None:
    """Wait for a parked replica's process to exit (SIGKILL after ``grace_s``), off the supervision loop."""
    deadline = time.monotonic() + grace_s
    while process.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if process.is_alive():
        process.kill()
    await asyncio.to_thread(process.join, 1.0)
