"""The ``Stage`` base class: what every stage shares, built-in or a plug-in.

A stage is handed its :class:`StageContext` (the pipeline description, its own name and replica,
the model directory) and a :class:`~pdflow.runtime.bus.Bus`. Its loop is
``recv -> dispatch -> (send)``: :meth:`Stage.handlers` maps each message type to a handler, and
handlers return quickly (long work goes to tasks or worker threads).

The base keeps the stage's one table of requests (:mod:`pdflow.runtime.requests`) and applies it
before any handler runs, for every message with a ``request_id``:

- a :class:`~pdflow.messages.Cancel` takes the one cancel path, :meth:`Stage.cancel`, which ends
  the request in the table and calls :meth:`Stage.on_cancel` with its state to free what it holds;
- a message for a request that ended is dropped;
- a message for a request not yet open is held (bounded, with a deadline) unless its type is in
  :attr:`Stage.opens`; once the opening handler has run, what was held is delivered in order;
- a handler that raises fails that request: ingress gets :class:`~pdflow.messages.RequestFailed`
  at once (the client an error), and the request is cancelled here;
- where the bus names the sender (CURVE), a message about a request is taken only from a replica
  on that request's route, of a stage that may send it here: ingress (which admits and cancels),
  a stage whose output the pipeline wires to this one, or, for a RequestFailed, any stage. Only
  ingress cancels. Anything else is dropped and counted (``forged``), so no process can act on
  a request that is not its own. A message about no one request that only ingress may send
  (``INGRESS_ONLY``: a KV forget) is likewise dropped from anyone else, and a report about a
  replica (``SELF_REPORTS``: a store's holdings, a prefix fetched between stores) from anyone but
  that replica.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import structlog

from pdflow.messages import (
    INGRESS_ONLY,
    SELF_REPORTS,
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    Message,
    Ready,
    RequestFailed,
    Route,
    SamplingParams,
    StageDown,
    StageStatus,
    StageUp,
)
from pdflow.runtime.bus import Bus, DropCounter, Sender
from pdflow.runtime.kinds import wired_to
from pdflow.runtime.requests import RequestTable, TableLimits

if TYPE_CHECKING:
    from pdflow.config.pipeline import Pipeline, StageConfig
    from pdflow.security.keys import StageKeys

Handler = Callable[[Any], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class StageContext:
    pipeline: Pipeline
    stage: str  # this stage's name in the pipeline
    replica: int
    model_dir: Path

    @property
    def config(self) -> StageConfig:
        return self.pipeline.stages[self.stage]


@dataclass(frozen=True, slots=True)
class Submission:
    """A request as ingress admits it: what :meth:`Stage.admission` builds its message from."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    skip_special_tokens: bool
    route: Route
    resume_ids: tuple[int, ...] = ()  # a migrated request: the tokens generated before (see EgressRequest)
    resume_chars: int = 0
    kv_ttl_s: float | None = None  # keep this request's KV at most this long (0: not at all)
    speculating: bool = False  # the pipeline decodes speculatively (decode then needs the prompt's tokens)


class Stage:
    """Subclass it, set the class attributes below, and implement the hooks you need.

    ``kind``: the registry name. ``messages``: the plug-in message types this stage sends or
    receives (subclasses of :class:`pdflow.messages.Message`; every bus decodes them). ``outputs``:
    where each named output goes by default (a pipeline may rewire it). ``opens``: the message
    types that open a request here (a handler of one that does not open it ends it: what was
    held for it is dropped). ``stateless``: the stage keeps nothing per request (a filter that
    passes each message on), so the table is not applied. ``receives_kv``: the stage has a data
    port (KV lands here). ``holds_kv``: the stage keeps KV across requests and handles
    :class:`~pdflow.messages.KvForget` (answering :class:`~pdflow.messages.KvForgotten`).
    ``computes_kv``: prompts' KV starts here and goes into a stage that holds KV (across hosts,
    ingress keeps the two on one host: :mod:`pdflow.routing.locality`).
    """

    kind: ClassVar[str] = ""
    messages: ClassVar[tuple[type, ...]] = ()
    outputs: ClassVar[dict[str, str]] = {}
    opens: ClassVar[tuple[type, ...]] = ()
    stateless: ClassVar[bool] = False
    receives_kv: ClassVar[bool] = False
    holds_kv: ClassVar[bool] = False
    computes_kv: ClassVar[bool] = False
    default_port: ClassVar[int | None] = None
    keys: StageKeys | None = None  # this replica's keys, when it runs as a process of a launcher

    def __init__(self, ctx: StageContext, bus: Bus):
        self.ctx = ctx
        self.pipeline = self.topology = ctx.pipeline
        self.config = ctx.config
        self.limits = ctx.pipeline.limits
        self.replica = ctx.replica
        self.bus = bus
        self.log = structlog.get_logger()
        timeout = self.limits.request_timeout_s
        self.requests: RequestTable = RequestTable(TableLimits(early_ttl_s=timeout, ended_ttl_s=2 * timeout))
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.crashed: BaseException | None = None
        self.forged = DropCounter("bus.message.forged")
        self.upstream = wired_to(ctx.pipeline, ctx.stage)

    @classmethod
    def admission(cls, submission: Submission, name: str) -> Message | None:
        """The message ingress sends this stage (named ``name`` in the pipeline) when it admits a
        request, or None when the stage hears of requests from its upstream only."""
        return None

    # --- for subclasses ---------------------------------------------------------------------

    async def setup(self) -> None:
        """Load what the stage needs (model, transports); called after the bus is bound."""

    async def teardown(self) -> None:
        """Release what setup() took."""

    def handlers(self) -> dict[type, Handler]:
        return {}

    def in_flight(self) -> int:
        return len(self.requests)

    def stats(self) -> dict[str, int]:
        """Counters this stage reports with each heartbeat (shown by ``/health``)."""
        return {}

    def notes(self) -> dict[str, str]:
        """Conditions in words this stage reports with each heartbeat (shown by ``/health``): what
        an operator must know that no counter says, e.g. a tier that turned itself off and why."""
        return {}

    @staticmethod
    def codec_stats(*transports) -> dict[str, int]:
        """For :meth:`stats`: the KV chunks ``transports`` (this stage's data-plane endpoints)
        encoded and decoded with links' codecs, and their bytes (nothing where no codec is used)."""
        totals: dict[str, int] = {}
        for transport in transports:
            for name, value in (getattr(transport, "counts", None) or {}).items():
                totals[name] = totals.get(name, 0) + value
        return totals if any(totals.values()) else {}

    def sent_stats(self, **senders) -> dict[str, int]:
        """For :meth:`stats`: the KV bytes each data-plane sender wrote, keyed
        ``kv_sent_bytes@<stage>`` after the stage its output (the keyword) goes to, and of those
        the bytes that went to another host, ``kv_network_bytes@<stage>``."""
        totals: dict[str, int] = {}
        for output, sender in senders.items():
            if sender is not None:
                peer = self.pipeline.stages[self.output(output)].display_name
                totals[f"kv_sent_bytes@{peer}"] = totals.get(f"kv_sent_bytes@{peer}", 0) + sender.sent_bytes
                key = f"kv_network_bytes@{peer}"
                totals[key] = totals.get(key, 0) + self.network_bytes(sender)
        return totals

    def network_bytes(self, sender) -> int:
        """The KV bytes ``sender`` wrote to peers on another host than this replica's."""
        from pdflow.transports import address_host

        here = {self.config.address_of(self.replica), self.config.bind_host_of(self.replica), "127.0.0.1",
                "localhost", "::1"}
        return sum(sent for peer, sent in sender.sent_by_peer().items()
                   if (host := address_host(peer)) is not None and host not in here)

    @staticmethod
    def copy_stats(*senders) -> dict[str, int]:
        """For :meth:`stats`: the KV bytes ``senders`` (data-plane transports) copied into their
        peers' memory and the bytes they found already in place, where they count them (shm)."""
        counts = [sender.copy_counts for sender in senders if sender.copy_counts is not None]
        if not counts:
            return {}
        return {"kv_copied_bytes": sum(c["copied_bytes"] for c in counts),
                "kv_in_place_bytes": sum(c["in_place_bytes"] for c in counts)}

    def on_cancel(self, request_id: str, state: Any, reason: str) -> Awaitable[None] | None:
        """Free what ``state`` holds; the request is already out of the table."""
        return None

    def on_stage_down(self, message: StageDown) -> Awaitable[None] | None:
        return None

    def on_stage_up(self, message: StageUp) -> Awaitable[None] | None:
        return None

    def on_stage_status(self, message: StageStatus) -> Awaitable[None] | None:
        return None

    def request_stop(self) -> None:
        """SIGTERM: the launcher stops ingress first, so the others have nothing left."""
        self.stopping.set()

    # --- for stages to call -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.display_name

    def output(self, name: str) -> str:
        """The stage that output ``name`` goes to in this pipeline."""
        return self.config.outputs.get(name) or type(self).outputs[name]

    def kv_sender(self, output: str):
        """A data-plane transport that writes KV to the stage ``output`` names, over the pipeline's
        link to it (encoding KV chunks with the link's codec)."""
        from pdflow import transports

        from pdflow.kv.coded import CodedTransport

        link = self.pipeline.link(self.ctx.stage, self.output(output))
        transport = transports.create(link.transport, host=self.config.bind_host_of(self.replica), **link.options)
        transport.authenticate(self.data_key)
        return CodedTransport(transport, link.make_codec(), self.pipeline.kv.block_tokens)

    def kv_receiver(self, output: str):
        """This replica's data-plane endpoint (on its data port) for KV from the stage ``output``
        names, over the pipeline's link from it; not started yet. Encoded KV (a link's codec) is
        decoded where it lands before its notice comes out."""
        from pdflow import transports
        from pdflow.kv.coded import CodedTransport

        link = self.pipeline.link(self.output(output), self.ctx.stage)
        transport = transports.create(link.transport, host=self.config.bind_host_of(self.replica),
                                      port=self.config.data_port_of(self.replica), **link.options)
        if self.config.address_of(self.replica) != self.config.bind_host_of(self.replica):
            transport.advertise(self.config.address_of(self.replica))  # it binds 0.0.0.0, say
        transport.authenticate(self.data_key)
        return CodedTransport(transport)

    @property
    def data_key(self) -> bytes | None:
        """The key this replica's KV connections prove (None: the pipeline does not authenticate)."""
        return self.keys.data_key if self.keys is not None and self.pipeline.security.authenticate else None

    async def notices(self, transport):
        """The chunk notices ``transport`` hands out, until it closes or the stage stops."""
        from pdflow.transports.errors import TransportClosed

        while not self.stopping.is_set():
            try:
                notice = await transport.next_notice()
            except TransportClosed:
                return
            yield notice

    async def send_output(self, output: str, route: Route, message: Message) -> None:
        stage = self.output(output)
        await self.bus.send(stage, route.of(stage), message)

    async def cancel(self, request_id: str, reason: str) -> None:
        """The one cancel path: end the request here and free what it holds (idempotent)."""
        state = self.requests.end(request_id)
        if state is not None:
            await _call(self.on_cancel, request_id, state, reason)

    def finish(self, request_id: str) -> Any:
        """The request is done here: out of the table (late messages for it are dropped)."""
        return self.requests.end(request_id)

    async def fail(self, request_id: str, error: str, route: Route | None = None, transient: bool = False) -> None:
        """Tell ingress the request failed here (the client gets ``error``), and cancel it.
        ``transient``: the request's KV was lost or damaged on the data plane; running it again
        may well succeed (ingress migrates it, within ``limits.max_migrations``)."""
        route = route or getattr(self.requests.get(request_id), "route", None)  # states carry their route
        self.log.error("request.failed", request_id=request_id, error=error)
        ingress = route.of("ingress") if route is not None else 0
        await self.bus.send("ingress", ingress, RequestFailed(request_id, self.name, error, transient))
        await self.cancel(request_id, "failed")

    def spawn(self, coro, *, essential: bool = False) -> asyncio.Task:
        """Run a task that is kept alive, and whose failure is logged, not lost. When an
        ``essential`` task (a loop the stage cannot work without) ends, the stage crashes, so the
        launcher restarts it instead of it going on deaf behind its heartbeats."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, essential))
        return task

    # --- the machinery ---------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task, essential: bool) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.log.error("stage.task.failed", task=task.get_coro().__qualname__, exc_info=error)
        if essential and not self.stopping.is_set():
            self.crashed = error or RuntimeError(f"{task.get_coro().__qualname__} ended")
            self.stopping.set()

    async def run(self) -> None:
        self.bus.start()
        await self.setup()
        await self.bus.send_launcher(Ready(self.ctx.stage, self.replica, os.getpid(), PROTOCOL_VERSION))
        self.log.info("stage.ready", pid=os.getpid())
        loops = [
            self.spawn(self._inbox_loop(), essential=True),
            self.spawn(self._launcher_loop(), essential=True),
            self.spawn(self._heartbeat_loop(), essential=True),
        ]
        await self.stopping.wait()
        self.log.info("stage.stopping", in_flight=self.in_flight())
        for task in loops:
            task.cancel()
        await self.teardown()
        for task in list(self._tasks):  # the stage's own loops and tasks end with it
            task.cancel()
        self.bus.close()
        if self.crashed is not None:
            raise RuntimeError("an essential loop of the stage ended") from self.crashed

    def may_act(self, sender: Sender | None, message: Message, request_id: str) -> bool:
        """May ``sender`` act on request ``request_id`` here (see the module doc)?"""
        if sender is None:
            return True  # a plane that cannot name senders (one process): nothing to check
        stage, replica = sender
        if stage != "ingress" and (type(message) is Cancel or
                                   (stage not in self.upstream and type(message) is not RequestFailed)):
            return False
        state = self.requests.get(request_id)
        if state is not None and not hasattr(state, "route"):
            return True  # a plug-in stage whose state keeps no route: it cannot be checked
        route = state.route if state is not None else getattr(message, "route", None)
        if route is None or not route.replicas:  # no route to check the replica against:
            return stage == "ingress" or type(message) in self.opens  # an opening message, or ingress
        return route.replicas.get(stage) == replica

    async def deliver(self, message: Message, table: dict[type, Handler] | None = None,
                      sender: Sender | None = None) -> None:
        """Apply the request table to ``message``, then run its handler (see the module doc)."""
        table = self.handlers() if table is None else table
        kind = type(message)
        request_id = None if self.stateless else getattr(message, "request_id", None)
        if request_id is not None:
            if (kind is Cancel or request_id in self.requests or kind in self.opens) and \
                    not self.may_act(sender, message, request_id):
                self.forged.drop(message=kind.__name__, request_id=request_id, sender=sender)
                return
            if kind is Cancel:
                await self.cancel(request_id, message.reason)
                return
            if self.requests.is_over(request_id):
                return  # late: the request ended here
            if kind not in self.opens and request_id not in self.requests:
                self.requests.hold(request_id, (sender, message))  # checked when it opens
                return
        elif kind in INGRESS_ONLY and sender is not None and sender[0] != "ingress":
            self.forged.drop(message=kind.__name__, sender=sender)
            return
        elif kind in SELF_REPORTS and sender is not None and sender != (message.stage, message.replica):
            self.forged.drop(message=kind.__name__, sender=sender)
            return
        handler = table.get(kind)
        if handler is None:
            self.log.warning("bus.unexpected", message=kind.__name__)
            return
        try:
            await _call(handler, message)
        except Exception as exc:
            self.log.exception("bus.handler.failed", message=kind.__name__, request_id=request_id)
            failed = getattr(message, "request_id", None)
            if failed is not None:
                error = f"{self.name} could not handle {kind.__name__}: {exc!r}"
                await self.fail(failed, error, getattr(message, "route", None))
            return
        if request_id is not None and kind in self.opens:
            early = self.requests.take_early(request_id)
            if request_id not in self.requests:
                if not self.requests.is_over(request_id):
                    self.requests.end(request_id)  # not opened after all: what was held is moot
                return
            for held_sender, held in early:
                await self.deliver(held, table, held_sender)

    async def _inbox_loop(self) -> None:
        table = self.handlers()
        while True:
            sender, message = await self.bus.recv_from()
            await self.deliver(message, table, sender)

    async def _launcher_loop(self) -> None:
        table = {StageDown: self.on_stage_down, StageUp: self.on_stage_up, StageStatus: self.on_stage_status}
        while True:
            message = await self.bus.recv_launcher()
            handler = table.get(type(message))
            if handler is None:
                continue
            try:
                if isinstance(message, StageDown) and message.stage == "ingress" and self.ctx.stage != "ingress":
                    await self._drop_orphans(message.replica)
                await _call(handler, message)
            except Exception:
                self.log.exception("bus.handler.failed", message=type(message).__name__)

    async def _drop_orphans(self, ingress: int) -> None:
        """Ingress replica ``ingress`` died: the clients of its requests went with it, so what this
        stage holds for them is cancelled (the other replicas' requests go on)."""
        orphans = [rid for rid, state in self.requests.active.items()
                   if (route := getattr(state, "route", None)) is not None and route.of("ingress") == ingress]
        for rid in orphans:
            await self.cancel(rid, f"ingress replica {ingress} went down")
        if orphans:
            self.log.info("requests.orphaned", ingress=ingress, cancelled=len(orphans))

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            stats = {**self.stats(), **self.bus.counters(), "control_forged": self.forged.count}
            await self.bus.send_launcher(Heartbeat(self.ctx.stage, self.replica, seq, self.in_flight(), stats,
                                                   self.notes()))
            self.requests.expire()
            seq += 1
            await asyncio.sleep(self.limits.heartbeat_interval_s)


async def _call(handler: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    """Run a hook or handler that may be a plain function or a coroutine function."""
    result = handler(*args)
    if inspect.isawaitable(result):
        await result
