"""kv-shuttle: the KV store, and the stage that moves each request's KV through it.

Its store (:class:`~pdflow.kv.store.KvStore`) is one arena of blocks, registered with the data
plane once (region 0), so chunks land straight in their slots. For each request:

1. ``KvExpected`` (ingress): the prompt's block ids; a lease holds the longest cached prefix
   (checksums verified) and takes slots for the rest; prefill hears what to skip and where to
   write (``KvPlan``). Where the prefix goes on in blocks that are on their way (an earlier
   request's prefill computing them, or an answer being written back), the plan waits for them
   instead of computing them twice: for an earlier prompt until it is stored, unless prefill gets
   to this request (``PlanWanted``) before that one has begun (it may be queued behind this one);
   for an answer at most ``_ARRIVING_WAIT_S``;
2. ``PrefixDestination`` (prefill) and ``KvDestination`` (decode): the cached prefix streams to
   both, layer by layer;
3. each chunk prefill writes is forwarded to decode the moment it lands (cut-through), and every
   full block is committed to the store once all its layers are in. With ``kv.direct``, a request
   with no prefix stored is planned once decode's pool destination is here (or prefill asks for
   the plan first): the plan carries it, prefill writes each layer into decode's pool and then
   here, and nothing is forwarded;
4. ``KvReleased`` (decode, at the request's end): the answer's KV that completes new blocks comes
   back (``KvReturnSlots``, then decode's chunks), is committed, and the leases are dropped.

Decode on the same host (shm, ``kv.zero_copy``) sends ``KvInPlace`` instead of a destination: it
maps the arena and attends from the request's own blocks. Nothing is forwarded then: the lease
grows by the blocks of the tokens decode may generate, decode hears where the blocks are once the
prompt's KV is all in (``KvInStore``), and at the end the answer's blocks are committed where
decode wrote them. With prefill computing into the arena too, no KV byte is copied between
prefill's forward pass and decode's attention.

With several replicas, ingress may name another one that holds more of the prompt's prefix
(``Route.fetch_from``, cache-aware routing): before its lease, the store has that replica write
the blocks it lacks into slots leased here, and serves such fetches to the other replicas
(:mod:`pdflow.stages.peer_fetch`).

A cancel, a failure or a lease deadline (a holder that died) drops the leases too; the slots the
request was writing are then reused only after a quarantine
(:data:`~pdflow.messages.LATE_WRITES_S`), since a chunk on its way, a forward pass or a decode step
computing in place may still write into them.

With a disk tier (``kv.disk_path``) every committed block is also written to disk in the
background (:mod:`pdflow.kv.tiering`), and a request whose prefix continues on disk past its
memory hit has those blocks read back into the store before its plan goes out: at once when it
arrives (``kv.prefetch``; prefill is usually busy with earlier requests then, so the read overlaps
the queue), or when prefill says it is about to compute it (``PlanWanted``). A restart finds what
was on disk; the leases of requests in flight die with the process that held them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from pdflow import transports
from pdflow.kv.arena import ArenaLayout
from pdflow.kv.blocks import BlockHasher, answer_blocks, reusable_blocks
from pdflow.kv.chunks import between_slots, from_slots, slot_of, tokens_of_run
from pdflow.kv.disk import DiskInUse, DiskTier
from pdflow.kv.holdings import Journal, pack_ids
from pdflow.kv.in_flight import InFlight, Writer
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.store import KvStore, Lease, StoreFull
from pdflow.kv.tiering import DiskBackedStore
from pdflow.messages import (
    LATE_WRITES_S,
    KvChunkHeader,
    KvDestination,
    KvExpected,
    KvFetch,
    KvFetched,
    KvForget,
    KvForgotten,
    KvHoldings,
    KvInPlace,
    KvInStore,
    KvPlan,
    KvReleased,
    KvReturnSlots,
    PlanWanted,
    PrefixDestination,
)
from pdflow.runtime.stage import Stage, Submission
from pdflow.stages.peer_fetch import PeerFetch

ARENA = 0  # the region the arena is registered as
_EXPIRY_INTERVAL_S = 1.0
_ANSWER_TTL_S = 60.0  # how long decode gets to write an answer's blocks
_ARRIVING_WAIT_S = 2.0  # how long a request waits for an answer's blocks already on their way
_DISK_EXPIRY_EVERY_S = 30.0  # how often expired blocks on disk are overwritten
_DRAIN_ON_STOP_S = 5.0  # a clean stop writes what is queued for disk, for at most this long
_HOLDINGS_EVERY_S = 0.25  # how often the store's changes go to ingress (cache-aware routing), at most
_HOLDINGS_FULL_EVERY_S = 10.0  # and how often all it holds, which repairs a report lost on the way
_LEASES_BY_KIND = {LeaseKind.REQUEST: "leases_requests", LeaseKind.ANSWER: "leases_answers",
                   LeaseKind.FETCH: "leases_fetching", LeaseKind.LOAD: "leases_loading",
                   LeaseKind.SERVE: "leases_serving"}
# the leases whose expiry ends a request here (not a load's: it ends with its own call, nor a serve's)
_ENDS_ITS_REQUEST = (LeaseKind.REQUEST, LeaseKind.ANSWER, LeaseKind.FETCH)


def lease_kinds(owners: list[LeaseOwner]) -> dict[str, int]:
    """How many leases of each kind: requests (their prompt), answers being written back,
    prefixes fetched from another replica, blocks loading from disk, blocks sent to another replica
    (what /health shows when memory stays leased)."""
    counts = dict.fromkeys(_LEASES_BY_KIND.values(), 0)
    for owner in owners:
        if owner.kind in _LEASES_BY_KIND:
            counts[_LEASES_BY_KIND[owner.kind]] += 1
    return counts


class Phase(Enum):
    """What kv-shuttle is doing for a request (the moves between phases: :data:`_NEXT`)."""

    PLANNING = "planning"  # nothing leased yet: waiting for blocks on their way, on disk or in a peer store
    RECEIVING = "receiving"  # leased: prefill's chunks land (each forwarded to decode, unless it attends here)
    PROMPT_IN = "prompt in"  # every layer of the prompt has landed
    IN_STORE = "in store"  # decode attends from the request's blocks here (KvInStore sent; no way back)
    ANSWERING = "answering"  # the answer's KV comes back from decode into slots leased for it


_NEXT = {
    Phase.PLANNING: (Phase.RECEIVING,),
    Phase.RECEIVING: (Phase.PROMPT_IN, Phase.ANSWERING),
    Phase.PROMPT_IN: (Phase.IN_STORE, Phase.ANSWERING),
    Phase.IN_STORE: (),
    Phase.ANSWERING: (),
}


@dataclass(slots=True, eq=False)
class _Entry:
    request: KvExpected
    decode_destination: asyncio.Future  # where decode wants the prompt's KV
    phase: Phase = Phase.PLANNING
    lease: Lease | None = None  # set once planned
    cached: int = 0  # prompt tokens whose KV came from the store
    landed: list[int] = field(default_factory=list)  # per block after the prefix: layer spans landed
    # per block after the prefix: its spans' checksums, each taken as a chunk covering the whole
    # span landed (None until then), so that the commits at the last layer read nothing again
    span_sums: list[list[int | None]] = field(default_factory=list)
    next_commit: int = 0
    answer: Lease | None = None
    answer_landed: list[int] = field(default_factory=list)
    answer_writer: Writer | None = None  # the answer's blocks on their way back, while a next turn may wait
    tasks: set = field(default_factory=set)
    decode_pool: ArenaLayout | None = None  # decode's pool, when its destination is one (checked once)
    layer_left: list[int] = field(default_factory=list)  # per layer: tokens still to land (keys and values)
    layer_in: list[float] = field(default_factory=list)  # per layer: when it was all in
    plan_wanted: asyncio.Future | None = None  # prefill is about to compute it (PlanWanted)
    arrival: int = 0  # its place in the order requests arrived here
    writer: Writer | None = None  # the prompt blocks it computes, while later requests may wait for them
    direct: bool = False  # prefill writes its KV into decode's pool itself (kv.direct): nothing to forward

    @property
    def route(self):
        return self.request.route

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def attends_here(self) -> bool:
        """Decode said it attends from the request's blocks here (``KvInPlace``)."""
        destination = self.decode_destination
        return destination.done() and not destination.cancelled() and isinstance(destination.result(), KvInPlace)

    def enter(self, phase: Phase) -> None:
        """Move on to ``phase``; RuntimeError if the request cannot get there from where it is."""
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"request {self.request.request_id}: no move from {self.phase.value} to {phase.value}")
        self.phase = phase


class KvShuttleStage(PeerFetch, Stage):
    kind = "kv_shuttle"
    outputs = {"destination": "prefill", "kv": "decode"}
    opens = (KvExpected,)
    receives_kv = True
    holds_kv = True  # ingress's KvForget comes here
    arena_region = ARENA

    @classmethod
    def admission(cls, submission: Submission, name: str) -> KvExpected:
        return KvExpected(submission.request_id, submission.prompt_ids, submission.route, submission.kv_ttl_s,
                          submission.sampling.prompt_logprobs is None)

    async def setup(self) -> None:
        topo = self.pipeline
        self.kv = KvLayout.from_model_dir(self.ctx.model_dir, topo.model.dtype)
        self.inbound = self.kv_receiver("destination")
        settings = topo.kv
        codec = settings.store_codec()  # None: blocks kept as they are
        layout = ArenaLayout.for_capacity(self.kv, settings.block_tokens, settings.store_bytes, codec)
        memory = self.inbound.allocate(ARENA, layout.nbytes)  # with shm: a shared segment
        if codec is not None:  # chunks into the arena arrive encoded by their senders and stay so
            self.inbound.keep(ARENA, codec, settings.block_tokens)
        self.disk_off = ""  # why the disk tier is off, where one was asked for
        disk = await self._open_disk(layout) if settings.disk_path is not None else None
        self.store = KvStore(self.kv, settings.block_tokens, settings.store_bytes, memory=memory,
                             high_watermark=settings.high_watermark, low_watermark=settings.low_watermark,
                             lease_ttl_s=self.limits.request_timeout_s, block_ttl_s=settings.block_ttl_s,
                             first_version=disk.max_version + 1 if disk is not None else 1, codec=codec)
        self.tiers = DiskBackedStore(self.store, disk) if disk is not None else None
        self.prefetch = settings.prefetch
        self.direct = settings.direct
        self.arena, self.memory = self.store.layout, self.store.span(0, self.store.layout.nbytes)
        self.hasher = BlockHasher.for_pipeline(topo)
        self.reuse = settings.prefix_cache
        self.computing = InFlight()  # blocks on their way in: prompts computed, answers written back
        self.arrivals = 0
        self.setup_peer_fetch()
        await self.inbound.start()
        self.address = self.inbound.address_for(ARENA)
        # answers (and other stores' blocks) may come over another transport than prefill's KV:
        # a store beside prefill takes prefill's over shm and decode's over the network
        self.answers_in, self.answers_address = None, self.address
        into_store = {self.pipeline.link(self.output(out), self.ctx.stage).transport for out in ("destination", "kv")}
        if len(into_store) > 1:
            self.answers_in = self.kv_receiver("kv")
            self.answers_in.register(ARENA, memory)
            if codec is not None:
                self.answers_in.keep(ARENA, codec, settings.block_tokens)
            await self.answers_in.start()
            self.answers_address = self.answers_in.address_for(ARENA)
            self.spawn(self._notice_loop(self.answers_in), essential=True)
        self.to_decode = self.kv_sender("kv")
        self.to_prefill = self.kv_sender("destination")
        self.spawn(self._notice_loop(self.inbound), essential=True)
        self.spawn(self._expiry_loop(), essential=True)
        from pdflow.routing import registry as routers

        if getattr(routers.load(topo.router.policy), "uses_holdings", False):  # ingress routes by what we hold
            self.store.journal = Journal()
            self.spawn(self._holdings_loop(), essential=True)
        if self.tiers is not None:
            self.spawn(self.tiers.run(), essential=True)
            self.spawn(self._disk_expiry_loop(), essential=True)
        self.log.info("store.ready", blocks=self.arena.num_slots, block_tokens=self.arena.block_tokens,
                      bytes=self.arena.nbytes, prefix_cache=self.reuse,
                      disk=str(self.tiers.disk.path) if self.tiers is not None else self.disk_off or "none")

    async def _open_disk(self, layout: ArenaLayout) -> DiskTier | None:
        """This replica's disk tier: its own directory under ``kv.disk_path`` for this KV layout
        (blocks of another model shape never meet). None, with one warning, if it cannot be had."""
        settings, kv = self.pipeline.kv, self.kv
        shape = f"{kv.num_layers}x{kv.num_kv_heads}x{kv.head_dim}-{kv.dtype}-{layout.block_tokens}t"
        where = settings.disk_path / shape / f"{self.ctx.stage}-{self.replica}"
        try:
            return await asyncio.to_thread(DiskTier, where, settings.disk_capacity, layout.block_bytes,
                                           segment_bytes=settings.disk_segment_bytes)
        except (OSError, DiskInUse) as exc:
            self.disk_off = f"{exc}"
            self.log.warning("store.disk_off", path=str(where), error=str(exc), hint="the store goes on in memory only")
            return None

    async def teardown(self) -> None:
        if self.tiers is not None:
            try:
                await asyncio.wait_for(self.tiers.drain(), _DRAIN_ON_STOP_S)
            except asyncio.TimeoutError:
                self.log.warning("store.disk_drain_timeout", queued=self.tiers.stats().spill_queued)
            await asyncio.to_thread(self.tiers.disk.close)
        await self.inbound.aclose()
        if self.answers_in is not None:
            await self.answers_in.aclose()
        await self.to_decode.aclose()
        await self.to_prefill.aclose()
        await self.close_peer_fetch()

    def handlers(self):
        return {
            KvExpected: self.on_expected, PrefixDestination: self.on_prefix_destination,
            KvDestination: self.on_decode_destination, KvInPlace: self.on_decode_destination,
            KvReleased: self.on_released, PlanWanted: self.on_plan_wanted, KvForget: self.on_forget,
            KvFetch: self.on_fetch, KvFetched: self.on_fetched,
        }

    def stats(self) -> dict[str, int]:
        stats = {**self.store.stats().as_dict(), **self.copy_stats(self.to_decode, self.to_prefill),
                 **self.codec_stats(self.inbound, *([self.answers_in] if self.answers_in else []), self.to_decode,
                                    self.to_prefill),
                 **self.sent_stats(kv=self.to_decode, destination=self.to_prefill), **self.peer_fetch_stats(),
                 "prefix_waits": self.computing.waits, "prefix_waits_given_up": self.computing.given_up,
                 **lease_kinds(self.store.lease_owners())}
        if self.tiers is not None:
            disk = self.tiers.disk.stats()
            stats.update({(name[:-2] + "_us", int(value * 1e6)) if name.endswith("_s") else (name, value)
                          for name, value in self.tiers.stats().as_dict().items()})  # (counters are ints)
            stats.update({f"disk_{name}": value for name, value in disk.as_dict().items() if name != "disabled"})
            stats["disk_enabled"] = int(not disk.disabled)
        return stats

    def notes(self) -> dict[str, str]:
        if self.tiers is not None and self.tiers.disk.disabled:
            return {"disk": f"off, memory only: {self.tiers.disk.disabled}"}
        return {"disk": f"off, memory only: {self.disk_off}"} if self.disk_off else {}

    # --- a request arrives: lease its blocks, tell prefill what to compute --------------------

    async def on_expected(self, message: KvExpected) -> None:
        self.arrivals += 1
        entry = _Entry(message, asyncio.get_running_loop().create_future(), arrival=self.arrivals)
        self.requests.open(message.request_id, entry)
        ids = self.hasher.ids(message.prompt_ids) if self.reuse and message.reuse_prefix else []
        if self._on_the_way(entry, ids) is None and not self._continues_on_disk(ids, len(message.prompt_ids)) \
                and self.fetch_peer(message) is None and not self.direct:
            await self._plan(entry, ids)
        else:  # blocks on their way, on disk or in another store, to wait for: not in the inbox's way
            self._spawn_for(entry, self._plan(entry, ids))

    def _continues_on_disk(self, ids: list[int], num_tokens: int) -> bool:
        """Does the prompt's prefix go on on disk after its memory hit?"""
        usable = reusable_blocks(len(ids), num_tokens, self.arena.block_tokens)
        return self.tiers is not None and usable > 0 and self.tiers.continues_on_disk(ids, usable)

    def _on_the_way(self, entry: _Entry, ids: list[int]) -> Writer | None:
        """What will store the first block of ``ids`` the store lacks: an earlier request whose
        prefill computes it, or an answer being written back; None if nothing."""
        missing = next((block_id for block_id in ids if block_id not in self.store), None)
        return self.computing.writer_of(missing, entry.arrival) if missing is not None else None

    async def _plan(self, entry: _Entry, ids: list[int]) -> None:
        """Lease the request's blocks (after any answer or earlier prompt on its way that extends
        its prefix) and tell prefill what to compute."""
        message = entry.request
        rid, n, bt = message.request_id, len(message.prompt_ids), self.arena.block_tokens
        while (writer := self._on_the_way(entry, ids)) is not None:
            wanted = entry.plan_wanted = entry.plan_wanted or asyncio.get_running_loop().create_future()
            if not await self.computing.wait(writer, wanted, self.limits.request_timeout_s):
                break
        total, usable = -(-n // bt), reusable_blocks(len(ids), n, bt)
        if self.tiers is not None and usable:
            await self._from_disk(entry, ids, usable)
            if rid not in self.requests:
                return  # cancelled meanwhile
        fetching = usable > 0 and await self.fetch_from_peer(message, ids, usable)  # holds a FETCH lease then
        try:
            if rid not in self.requests:
                return  # cancelled meanwhile
            lease = self.store.lease(LeaseOwner(rid), ids, total - len(ids), verify=True, count=self.reuse,
                                     max_hit=usable, keep_s=message.keep_s, prompt_tokens=n)
        except StoreFull as exc:
            await self.fail(rid, f"the KV store cannot hold this request's {n} tokens: {exc}", message.route)
            return
        finally:
            if fetching:  # its blocks are held by the request's lease now (or no longer wanted)
                self.store.release(LeaseOwner(rid, LeaseKind.FETCH))
        if self.tiers is not None:
            self.tiers.touch(ids[: lease.hit])
        entry.lease, entry.cached, entry.next_commit = lease, lease.hit * bt, lease.hit
        entry.enter(Phase.RECEIVING)
        if self.reuse and lease.hit < len(ids):  # later requests sharing these blocks may wait for them
            entry.writer = self.computing.add(entry.arrival, ids[lease.hit :])
        entry.landed = [0] * (total - lease.hit)
        entry.span_sums = [[None] * (2 * self.kv.num_layers) for _ in entry.landed]
        entry.layer_left = [2 * (n - entry.cached)] * self.kv.num_layers
        entry.layer_in = [0.0] * self.kv.num_layers
        if not any(entry.layer_left):  # an empty prompt: nothing to land (any other leaves prefill its last token)
            entry.enter(Phase.PROMPT_IN)
        direct = await self._direct_destination(entry) if self.direct and not entry.cached else None
        if rid not in self.requests:
            return  # cancelled meanwhile (its lease went with it)
        entry.direct = direct is not None
        plan = KvPlan(rid, self.address, ARENA, self.arena.num_slots, entry.cached, lease.slots[lease.hit :],
                      lease.slots[: lease.hit], direct)
        await self.send_output("destination", message.route, plan)
        destination = entry.decode_destination
        if entry.cached and destination.done() and not destination.cancelled():
            self._prefix_to_decode(entry, destination.result())

    async def _direct_destination(self, entry: _Entry) -> KvDestination | None:
        """Decode's pool destination for the direct path (``kv.direct``): waited for until it is
        here or prefill asks for the plan, whichever is first; None where the request goes through
        the store (prefill got there first, decode attends here or took no pool blocks for it)."""
        destination = entry.decode_destination
        if not destination.done():
            entry.plan_wanted = entry.plan_wanted or asyncio.get_running_loop().create_future()
            await asyncio.wait([destination, entry.plan_wanted], timeout=self.limits.request_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        if not destination.done() or destination.cancelled():
            return None
        found = destination.result()
        blocks = -(-entry.num_tokens // self.arena.block_tokens)
        if not isinstance(found, KvDestination) or len(found.slots) < blocks or -1 in found.slots[:blocks]:
            return None
        return found

    async def _from_disk(self, entry: _Entry, ids: list[int], usable: int) -> None:
        """The blocks of the prompt's prefix that follow its memory hit and are on disk, into
        memory: now (prefetch), or once prefill is about to compute the request."""
        if not self.tiers.continues_on_disk(ids, usable):
            return
        rid = entry.request.request_id
        if not self.prefetch:
            entry.plan_wanted = entry.plan_wanted or asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(entry.plan_wanted), self.limits.request_timeout_s)
            except asyncio.TimeoutError:
                return
        began = time.monotonic()
        loaded = await self.tiers.load(rid, ids, usable)
        self.log.debug("store.from_disk", request_id=rid, blocks=loaded, ms=round(1000 * (time.monotonic() - began), 2),
                       prefetch=self.prefetch)

    def on_plan_wanted(self, message: PlanWanted) -> None:
        entry: _Entry = self.requests.get(message.request_id)
        entry.plan_wanted = entry.plan_wanted or asyncio.get_running_loop().create_future()
        if not entry.plan_wanted.done():
            entry.plan_wanted.set_result(None)

    async def on_forget(self, message: KvForget) -> None:
        """Drop a prefix's KV (and all built on it), or everything, from memory and disk; say how much."""
        ids = None if message.everything else self.hasher.ids(message.prompt_ids)
        if ids == []:
            memory = disk = 0
        elif self.tiers is not None:
            memory, disk = await self.tiers.forget(ids)
        else:
            memory, disk = self.store.forget(ids), 0
        self.log.info("store.forgot", everything=message.everything, memory_blocks=memory, disk_blocks=disk)
        await self.bus.broadcast("ingress", KvForgotten(  # (the ingress that asked knows its id)
            message.forget_id, self.ctx.stage, self.replica, memory, disk))

    def on_prefix_destination(self, message: PrefixDestination) -> None:
        entry: _Entry = self.requests.get(message.request_id)
        if entry.phase is Phase.PLANNING:
            raise RuntimeError("prefill asked for a prefix before the request was planned")
        rid = message.request_id

        def chunks(layer: int, slots: list[int]):
            return from_slots(rid, self.arena, self.memory, layer, slots, entry.cached, entry.cached, message.region)

        self._spawn_for(entry, self._send_prefix(entry, self.to_prefill, message.address, chunks, "prefill"))

    def _decode_pool(self, entry: _Entry, message: KvDestination) -> ArenaLayout:
        """Decode's pool, as its destination describes it (which must hold the request)."""
        pool = ArenaLayout(self.kv, self.arena.block_tokens, message.num_slots)
        blocks = -(-entry.num_tokens // pool.block_tokens)
        if len(message.slots) < blocks or pool.nbytes > message.nbytes or \
                any(not -1 <= slot < message.num_slots for slot in message.slots[:blocks]):  # -1: not wanted
            raise ValueError(f"decode's destination cannot hold the request's {entry.num_tokens} tokens: "
                             f"{len(message.slots)} slots of {message.num_slots}, {message.nbytes} bytes")
        return pool

    def on_decode_destination(self, message: KvDestination | KvInPlace) -> None:
        entry: _Entry = self.requests.get(message.request_id)
        if entry.decode_destination.done():
            return  # decode names one destination per request: a second one is ignored
        if isinstance(message, KvDestination) and message.slots:  # checked once, where a bad one fails it
            entry.decode_pool = self._decode_pool(entry, message)
        entry.decode_destination.set_result(message)
        if entry.phase is not Phase.PLANNING and entry.cached:  # else _plan sends it once planned
            self._prefix_to_decode(entry, message)
        self._maybe_in_store(entry)

    def _maybe_in_store(self, entry: _Entry) -> None:
        """Decode attends from the request's blocks here: once the prompt's KV is all in, grow the
        lease by the blocks decode will write and tell it where they all are."""
        if entry.phase is not Phase.PROMPT_IN or not entry.attends_here:
            return
        rid, bt = entry.request.request_id, self.arena.block_tokens
        entry.enter(Phase.IN_STORE)
        wanted = -(-max(entry.decode_destination.result().tokens, entry.num_tokens) // bt)
        try:
            self.store.grow_lease(LeaseOwner(rid), max(0, wanted - len(entry.lease.slots)))
        except StoreFull as exc:
            self.spawn(self.fail(rid, f"the KV store cannot hold the blocks this request may generate into "
                                      f"(kv.store_bytes): {exc}", entry.route))
            return
        reply = KvInStore(rid, self.address, ARENA, self.arena.num_slots, entry.lease.slots[:wanted], entry.layer_in)
        self.spawn(self.send_output("kv", entry.route, reply))

    def _prefix_to_decode(self, entry: _Entry, destination: KvDestination | KvInPlace) -> None:
        if isinstance(destination, KvInPlace):
            return  # decode reads the prefix where it is
        rid, region = entry.request.request_id, destination.region

        def chunks(layer: int, slots: list[int]):
            if destination.slots:  # straight into decode's pool blocks
                return between_slots(rid, self.arena, self.memory, layer, (KEYS, VALUES), slots, 0, entry.cached,
                                     entry.decode_pool, destination.slots, region)
            return from_slots(rid, self.arena, self.memory, layer, slots, entry.cached, entry.num_tokens, region)

        self._spawn_for(entry, self._send_prefix(entry, self.to_decode, destination.address, chunks, "decode"))

    # --- moving bytes -------------------------------------------------------------------------

    def _spawn_for(self, entry: _Entry, coro) -> None:
        task = asyncio.ensure_future(coro)
        entry.tasks.add(task)
        task.add_done_callback(entry.tasks.discard)

    async def _send_prefix(self, entry: _Entry, transport, address: str, chunks, to: str) -> None:
        """The cached prefix, layer by layer (``chunks(layer, slots)``: where each part goes)."""
        rid = entry.request.request_id
        slots = entry.lease.slots[: entry.cached // self.arena.block_tokens]
        try:
            for layer in range(self.kv.num_layers):
                for header, data in chunks(layer, slots):
                    await transport.write(address, header, data)
        except asyncio.CancelledError:
            pass
        except transports.TransportError as exc:
            if rid in self.requests:
                await self.fail(rid, f"sending the cached prefix to {to} failed: {exc!r}", transient=True)

    async def _forward(self, entry: _Entry, header: KvChunkHeader) -> None:
        """A chunk prefill wrote into the arena, on to decode: into its pool's blocks (split where
        its slots are not consecutive), or into its buffer of the prompt."""
        rid = entry.request.request_id
        try:
            destination = await asyncio.wait_for(asyncio.shield(entry.decode_destination), self.limits.request_timeout_s)
            if isinstance(destination, KvInPlace):
                return  # decode reads it where it landed
            if destination.slots:
                first, bt = slot_of(self.arena, header), self.arena.block_tokens
                src = range(first, first + -(-header.token_end // bt) - header.token_start // bt)
                for part, data in between_slots(rid, self.arena, self.memory, header.layer, (header.kind,), src,
                                                header.token_start, header.token_end, entry.decode_pool,
                                                destination.slots, destination.region):
                    await self.to_decode.write(destination.address, part, data)
                return
            data = self.memory[header.offset : header.offset + header.nbytes]
            offset = self.kv.offset(entry.num_tokens, header.layer, header.kind, header.token_start)
            await self.to_decode.write(destination.address,
                                       msgspec.structs.replace(header, region=destination.region, offset=offset), data)
        except asyncio.CancelledError:
            pass
        except (transports.TransportError, asyncio.TimeoutError) as exc:
            if rid in self.requests:
                await self.fail(rid, f"KV transfer to decode failed: {exc!r}", transient=True)

    async def _notice_loop(self, inbound) -> None:
        async for notice in self.notices(inbound):
            header = notice.header
            if self.fetched_chunk_landed(notice):  # a prefix from another store
                continue
            entry = self.requests.get(header.request_id)
            if entry is None or entry.phase is Phase.PLANNING:
                continue  # ended meanwhile (or a stray chunk before any plan)
            if notice.error is not None:
                await self.fail(header.request_id, f"KV chunk lost on its way into the store: {notice.error!r}",
                                transient=True)
                continue
            self.store.renew(LeaseOwner(header.request_id))
            if entry.phase is Phase.ANSWERING:
                self._answer_landed(entry, header)
            else:
                if not entry.direct:  # (direct: prefill wrote it into decode's pool itself)
                    self._spawn_for(entry, self._forward(entry, header))
                self._prompt_landed(entry, header)

    def _blocks_of(self, header: KvChunkHeader, first_block: int) -> range:
        bt = self.arena.block_tokens
        return range(header.token_start // bt - first_block, -(-header.token_end // bt) - first_block)

    def _prompt_landed(self, entry: _Entry, header: KvChunkHeader) -> None:
        """Count the chunk's blocks; commit each full block once all its layers are in, in order."""
        if 0 <= header.layer < len(entry.layer_left) and entry.layer_left[header.layer] > 0:
            entry.layer_left[header.layer] -= tokens_of_run(header)
            if entry.layer_left[header.layer] <= 0:
                entry.layer_in[header.layer] = time.monotonic()
                if not any(entry.layer_left):
                    entry.enter(Phase.PROMPT_IN)
                    self._maybe_in_store(entry)
        if entry.writer is not None:
            entry.writer.began = True
        bt = self.arena.block_tokens
        usable = entry.cached // bt
        committed = min(entry.num_tokens // bt, len(entry.lease.ids))  # the blocks it commits: full, with ids
        span = 2 * header.layer + header.kind if header.kind in (KEYS, VALUES) and \
            0 <= header.layer < self.kv.num_layers and self.reuse else None
        for i in self._blocks_of(header, usable):
            if 0 <= i < len(entry.landed):
                entry.landed[i] += 1
                block = usable + i
                if span is not None and block < committed and \
                        header.token_start <= block * bt and (block + 1) * bt <= header.token_end:
                    entry.span_sums[i][span] = self.store.span_checksum(entry.lease.slots[block], header.layer,
                                                                        header.kind)
        spans = 2 * self.kv.num_layers
        while self.reuse and entry.next_commit < committed and entry.landed[entry.next_commit - usable] == spans:
            sums = entry.span_sums[entry.next_commit - usable]
            self.store.commit(entry.lease, entry.next_commit, checksums=None if None in sums else sums)
            entry.next_commit += 1
        if entry.next_commit >= committed:
            self.computing.done(entry.writer)

    # --- the request ends: its answer into the store, leases dropped -------------------------

    async def on_released(self, message: KvReleased) -> None:
        """The request ended at decode: store its answer's new blocks (if any), then drop its leases."""
        rid = message.request_id
        entry: _Entry = self.requests.get(rid)
        bt, n = self.arena.block_tokens, entry.num_tokens
        blocks = answer_blocks(n, n + len(message.output_ids), bt)
        # no output: it ended unfinished (cancelled, failed), and a writer may not have stopped yet
        unfinished = not message.output_ids
        reuse = self.reuse and entry.request.reuse_prefix  # (not: its prompt's blocks were not stored either)
        if entry.phase is Phase.IN_STORE:  # decode wrote the answer's KV into the request's own blocks here
            if reuse and blocks and not unfinished:
                self._commit_in_place(entry, message.output_ids, blocks)
            self._end(rid, unfinished)
            return
        # (a second KvReleased, after an answer was offered: decode gave it up)
        if not (reuse and message.output_ids and blocks and entry.phase in (Phase.RECEIVING, Phase.PROMPT_IN)):
            self._end(rid, unfinished)
            return
        ids = self.hasher.ids(entry.request.prompt_ids + message.output_ids)[: blocks.stop]
        owner = LeaseOwner(rid, LeaseKind.ANSWER)
        try:
            answer = self.store.lease(owner, ids, verify=False, count=False, ttl_s=_ANSWER_TTL_S,
                                      keep_s=entry.request.keep_s)
        except StoreFull:
            answer = self.store.lease(owner, [], verify=False, count=False)  # no room: keep none
        if answer.hit < blocks.start:  # the prompt's blocks are not all stored: the answer's cannot hang there
            self.store.release(owner)
            answer = self.store.lease(owner, [], verify=False, count=False)
        entry.answer = answer
        entry.enter(Phase.ANSWERING)
        first = answer.hit if answer.ids else blocks.stop
        entry.answer_landed = [0] * (blocks.stop - first)
        if answer.new_slots:  # the next turn of this chat may arrive before they do: it waits for them
            entry.answer_writer = self.computing.add(0, answer.ids[answer.hit :], began=True,
                                                     patience_s=_ARRIVING_WAIT_S)
        reply = KvReturnSlots(rid, self.answers_address, ARENA, self.arena.num_slots, first * bt, answer.new_slots)
        await self.send_output("kv", entry.route, reply)
        if not answer.new_slots:
            self._end(rid)

    def _commit_in_place(self, entry: _Entry, output_ids: list[int], blocks: range) -> None:
        """Index the answer's blocks where decode wrote them (the request's lease holds them)."""
        lease = entry.lease
        ids = self.hasher.ids(entry.request.prompt_ids + output_ids)[: blocks.stop]
        self.store.grow_lease(LeaseOwner(entry.request.request_id), ids=ids)
        for i in range(blocks.start, min(blocks.stop, len(lease.slots))):
            self.store.commit(lease, i)  # (False: stored already, or its parent is gone)

    def _answer_landed(self, entry: _Entry, header: KvChunkHeader) -> None:
        answer = entry.answer
        for i in self._blocks_of(header, answer.hit):
            if 0 <= i < len(entry.answer_landed):
                entry.answer_landed[i] += 1
        if all(count == 2 * self.kv.num_layers for count in entry.answer_landed):
            for i in range(answer.hit, len(answer.ids)):
                self.store.commit(answer, i)
            self._end(entry.request.request_id)

    def _end(self, request_id: str, unfinished: bool = False) -> None:
        entry = self.finish(request_id)
        if entry is not None:
            self._free(entry, unfinished)

    def on_cancel(self, request_id: str, entry: _Entry, reason: str) -> None:
        self._free(entry, unfinished=True)

    def _free(self, entry: _Entry, unfinished: bool) -> None:
        rid = entry.request.request_id
        quarantine = LATE_WRITES_S if unfinished else 0.0
        self.store.release(LeaseOwner(rid), quarantine)
        self.store.release(LeaseOwner(rid, LeaseKind.ANSWER), quarantine)
        self.computing.done(entry.writer)  # stored, or never will be: whoever waits goes on
        self.computing.done(entry.answer_writer)
        entry.decode_destination.cancel()
        for task in entry.tasks:
            task.cancel()

    async def _disk_expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(_DISK_EXPIRY_EVERY_S)
            await asyncio.to_thread(self.tiers.disk.expire)

    async def _holdings_loop(self) -> None:
        """Tell ingress what the store indexed and dropped, a few times a second while it changes,
        and all it holds now and then (:mod:`pdflow.kv.holdings`)."""
        seq, last_full = 0, -float("inf")
        while True:
            added, removed = self.store.journal.drain()
            now = time.monotonic()
            if now - last_full >= _HOLDINGS_FULL_EVERY_S:
                report = KvHoldings(self.ctx.stage, self.replica, seq, True, pack_ids(self.store.block_ids()))
                last_full = now
            elif added or removed:
                report = KvHoldings(self.ctx.stage, self.replica, seq, False, pack_ids(added), pack_ids(removed))
            else:
                report = None
            if report is not None:
                await self.bus.broadcast("ingress", report)
                seq += 1
            await asyncio.sleep(_HOLDINGS_EVERY_S)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_INTERVAL_S)
            for owner in self.store.expire(quarantine_s=LATE_WRITES_S):
                self.log.warning("store.lease_expired", request_id=owner.request_id, lease=owner.kind.value)
                if owner.kind in _ENDS_ITS_REQUEST:
                    self._end(owner.request_id, unfinished=True)
