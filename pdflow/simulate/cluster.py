"""A discrete-event model of a PD pipeline: ingress routing with pdflow's own routers, prefill
replicas, KV stores, decode replicas with continuous batching, the links between them, and
pdflow's own scaler; stage costs from a :class:`~pdflow.simulate.profile.Profile`.

What is modelled, and how:

- **Ingress** routes each request on arrival, per stage (``prefill``, ``kv_shuttle``,
  ``decode``), through the :class:`~pdflow.routing.Router` the run names, as pdflow's ingress does:
  healthy (ready, not draining) replicas only, each with its exact count of requests held; for a
  router that asks, each store's prefix of the prompt (blocks it holds or is receiving) and what it
  has stored (what could be fetched). The prompt is a :class:`~pdflow.simulate.workload.TracePrompt`.
- **Stores** (one per kv-shuttle replica) hold blocks under LRU (``store_blocks`` each; None: no
  limit). A request reads the leading run of its blocks its store holds (whole blocks, never the
  prompt's last token, as pdflow); a router's ``fetch_from`` adds the run another store has
  beyond that, at ``fetch_gbit_per_s``; every block is stored once prefill ends.
- **Prefill** replicas take requests first come first served, one at a time; the new tokens of a
  prompt with ``c`` cached cost ``F(c + n) - F(c)`` (:meth:`Profile.prefill_s`). The store sends
  the cached prefix over the link when the request reaches prefill's queue, and prefill computes
  layer ``l`` once that layer of it is in: with ``T`` the whole prefix's transfer and ``P`` the
  compute over ``L`` layers, prefill ends at the latest of its start + ``P``, the prefix's first
  layer in + ``P`` and its last layer in + ``P / L``.
- **The links**: decode holds all of a request's KV (prefix read from the store and new tokens
  alike) the streamed tail after prefill ends (:func:`pdflow.plan.transfer.transfer`'s, layer
  streaming), on links that are shared: each prefill replica's link carries the KV it computed,
  each decode replica's all of a request's KV (the store sends the cached prefix), one transfer
  at a time (first come first served), so transfers that the links cannot keep up with queue.
  (The stores' own links, and the prefix's trip from the store to prefill, are not shared.)
  With a ``placement`` the links are the hosts' NICs instead, the stores central or beside each
  prefill host (which ingress then routes a request to together): :mod:`pdflow.simulate.network`.
- **The first token** goes out when prefill ends (prefill samples it and sends it, as pdflow's
  prefill stage does); a request of one token is done then and never reaches decode.
- **Decode** replicas run continuous batching up to ``max_batch``: a request joins at a step
  boundary once its KV is in; every step emits one token per sequence and costs
  :meth:`Profile.decode_step_s` at the batch's size and mean context. A request's first gap (its
  first token to its second) is therefore the KV tail, the wait for the running step to end and
  its first step. Between joins and ends the steps are advanced in one event. With the profile's
  ``decode_gap_ratios`` each step lasts the step times a ratio drawn from them, from the busy
  percentiles while the prefill replica of decode's number computes (the two share a host, as in
  the default topology) and from the idle ones otherwise; a run of steps is cut where that
  prefill starts or stops, so the steps after it draw from the other.
- **Colocated** (``mode = "colocated"``: pdflow's worker stage, the baseline): each worker
  replica keeps its own store and loops as :mod:`pdflow.stages.worker` does. An iteration does the
  prefill work (the queue's head, whole or at most ``chunked_prefill_tokens`` tokens of it, again
  and again while the batch has room and the budget lasts, prompts arriving meanwhile included:
  the worker reads its queue as it goes), then one decode step for the batch with the prompts just
  prefilled in it; only then do those prompts' first tokens go out, together with the step's. A
  running sequence's gap between tokens includes the prefill work done between its steps. With
  nothing to prefill, steps run back to back. With the profile's ``worker_ratios`` each
  iteration that prefills takes its prediction times a ratio drawn from them, and with its
  ``worker_step_extra_s`` each other step the step and an extra drawn for its batch size
  (:meth:`Profile.worker_step_extra`). Routed as stage
  ``worker``, whose stores a router that asks is told about.
- **The scaler**: pdflow's :class:`~pdflow.runtime.scaler.Scaler` decides every ``interval_s``
  from the same :class:`~pdflow.runtime.scaler.Load` the launcher builds (running replicas,
  prefill's queue, decode's batch, TTFT and TBT p90 over ``window_s``); a started replica is ready
  ``replica_start_s`` later; a stopped one drains first.

Not modelled: the control plane's own latency, tokenization and detokenization, contention on the
stores' links, store eviction of blocks in use, failures.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdflow.plan.transfer import bytes_per_s
from pdflow.routing import ReplicaStatus, Router, RoutingRequest
from pdflow.simulate.network import Network
from pdflow.simulate.profile import Profile
from pdflow.simulate.workload import SimRequest, TracePrompt

__all__ = ["Cluster", "Deployment"]


@dataclass(frozen=True)
class Deployment:
    prefill: int = 1
    decode: int = 1
    stores: int | None = None  # kv-shuttle replicas; None: one per prefill replica
    store_blocks: int | None = None  # blocks each store holds; None: no limit
    block_tokens: int = 512
    kv_streaming: str = "layer"  # or "request": the transfer starts when prefill ends
    # the scaler: per stage the fewest replicas to run (None: not scaled; prefill/decode above
    # are then the most)
    min_prefill: int | None = None
    min_decode: int | None = None
    mode: str = "disaggregated"  # or "colocated": ``workers`` worker replicas instead of P and D
    workers: int = 1
    chunked_prefill_tokens: int = 0  # colocated: at most this many prompt tokens per iteration (0: whole)
    # where the stores run, with a NIC per host (pdflow.simulate.network): "central", "beside",
    # "direct"; None: the links of prefill and decode replicas only (the stores' not modelled)
    placement: str | None = None
    nic_gbit_per_s: float | None = None  # each host's NIC, each way (None: the profile's link)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', not {self.mode!r}")
        counts = (("workers", self.workers),) if self.mode == "colocated" else \
            (("prefill", self.prefill), ("decode", self.decode))
        for name, value in (*counts, ("block_tokens", self.block_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.mode == "colocated" and (self.min_prefill is not None or self.min_decode is not None):
            raise ValueError("the scaler starts and stops prefill and decode replicas: not with mode = 'colocated'")
        if self.placement is not None and self.mode == "colocated":
            raise ValueError("a placement of stores is a disaggregated deployment's: not with mode = 'colocated'")


class _Store:
    def __init__(self, capacity: int | None) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.coming: dict[int, int] = {}  # block -> requests routed here that will store it

    def prefix(self, ids: Sequence[int], coming: bool) -> int:
        n = 0
        for block in ids:
            if block in self.blocks or (coming and block in self.coming):
                n += 1
            else:
                break
        return n

    def touch(self, ids: Sequence[int]) -> None:
        blocks = self.blocks
        for block in ids:
            blocks[block] = None
            blocks.move_to_end(block)
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)

    def expect(self, ids: Sequence[int], delta: int) -> None:
        for block in ids:
            left = self.coming.get(block, 0) + delta
            if left > 0:
                self.coming[block] = left
            else:
                self.coming.pop(block, None)


class _Replica:
    def __init__(self, number: int, parked: bool = False) -> None:
        self.number = number
        self.parked = parked
        self.ready_at = 0.0
        self.draining = False
        self.assigned = 0  # requests routed here and not done with it

    def routable(self, now: float) -> bool:
        return not self.parked and not self.draining and now >= self.ready_at


class _Prefill(_Replica):
    def __init__(self, number: int, parked: bool = False) -> None:
        super().__init__(number, parked)
        self.queue: deque[SimRequest] = deque()
        self.busy = False
        self.link_free_s = 0.0  # when its link has sent every byte it was given so far


class _Seq:
    __slots__ = ("request", "left", "context", "last_s")

    def __init__(self, request: SimRequest, left: int, context: int, last_s: float = 0.0) -> None:
        self.request, self.left, self.context, self.last_s = request, left, context, last_s


class _Worker(_Replica):
    """A colocated worker: its queue, the prompt it is part way through, its batch and its store."""

    def __init__(self, number: int, capacity: int | None) -> None:
        super().__init__(number)
        self.waiting: deque[SimRequest] = deque()
        self.prefilled = 0  # tokens of the head prompt computed (chunked prefill)
        self.running: list[_Seq] = []
        self.store = _Store(capacity)
        self.busy = False
        self.budget: int | None = None  # prompt tokens this iteration may still prefill (None: no limit)
        self.finishing: SimRequest | None = None  # the prompt whose prefill ends at the next event
        self.prefilled_now: list[SimRequest] = []  # prompts prefilled in this iteration
        self.run_start = 0.0
        self.step_s = 0.0
        self.steps = 0  # planned decode-only steps of this run (0: an iteration, or idle)
        self.version = 0
        # with the profile's worker ratios (:attr:`Profile.worker_ratios`): this iteration's, whether it
        # did prefill work, and a decode-only run's steps' ratios and ends (as _Decode's)
        self.ratio = 1.0
        self.prefilling_now = False
        self.ratios: list[float] | None = None
        self.ends: list[float] = []


class _Decode(_Replica):
    def __init__(self, number: int, parked: bool = False) -> None:
        super().__init__(number, parked)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[_Seq] = []
        self.run_start = 0.0
        self.step_s = 0.0
        self.steps = 0  # planned in this run
        self.version = 0  # a tick of an older plan is ignored
        self.link_free_s = 0.0  # when its link has taken in every byte sent to it so far
        # with drawn gap ratios: each planned step's ratio, and its end from run_start (else None:
        # every step is step_s)
        self.ratios: list[float] | None = None
        self.ends: list[float] = []


class Cluster:
    def __init__(self, profile: Profile, deployment: Deployment, router: Router, scaler=None, seed: int = 0) -> None:
        self.profile, self.deploy, self.router, self.scaler = profile, deployment, router, scaler
        self.rng = random.Random(seed)  # the gap ratios' draws
        self._drawn = bool(profile.decode_gap_ratios)
        self._worker_ratios = bool(profile.worker_ratios)
        self._worker_extras = bool(profile.worker_step_extra_s)
        d = deployment
        colocated = d.mode == "colocated"
        self.prefills = [] if colocated else [_Prefill(i, d.min_prefill is not None and i >= d.min_prefill)
                                              for i in range(d.prefill)]
        self.decodes = [] if colocated else [_Decode(i, d.min_decode is not None and i >= d.min_decode)
                                             for i in range(d.decode)]
        self.workers = [_Worker(i, d.store_blocks) for i in range(d.workers)] if colocated else []
        self.stores = [w.store for w in self.workers] if colocated else [_Store(d.store_blocks)
                                                                         for _ in range(d.stores or d.prefill)]
        self.store_load = [0] * len(self.stores)
        self.events: list = []
        self._order = itertools.count()
        self.now = 0.0
        self.finished: list[SimRequest] = []
        self.recent_ttft: deque[tuple[float, float]] = deque()
        self.recent_tbt: deque[tuple[float, float]] = deque()
        self.replica_log: list[tuple[float, int, int]] = []  # (time, prefill running, decode running)
        self._fetch_rate = bytes_per_s(profile.fetch_gbit_per_s)
        self._link_rate = bytes_per_s(profile.link_gbit_per_s)
        self.network = None if d.placement is None or colocated else Network(
            d.placement, d.prefill, d.decode, len(self.stores), bytes_per_s(d.nic_gbit_per_s or profile.link_gbit_per_s),
            profile.link_latency_s)

    # --- the event loop ---------------------------------------------------------------------

    def _at(self, when: float, action, *args) -> None:
        assert when >= self.now - 1e-9, f"an event in the past ({when} < {self.now})"
        heapq.heappush(self.events, (when, next(self._order), action, args))

    def run(self, requests: list[SimRequest], scaler_interval_s: float = 1.0) -> list[SimRequest]:
        for request in requests:
            self._at(request.arrival_s, self._arrive, request)
        if self.scaler is not None:
            self._at(0.0, self._scale, scaler_interval_s)
        self._log_replicas()
        while self.events and len(self.finished) < len(requests):
            self.now, _, action, args = heapq.heappop(self.events)
            action(*args)
        return self.finished

    # --- ingress ----------------------------------------------------------------------------

    def _statuses(self, replicas: list[_Replica]) -> list[ReplicaStatus]:
        return [ReplicaStatus(r.number, in_flight=r.assigned, assigned=r.assigned)
                for r in replicas if r.routable(self.now)]

    def _holdings(self, request: SimRequest, loads: list[int]) -> list[ReplicaStatus]:
        """The stores' statuses: their prefix of the prompt, for a router that asks."""
        block = self.deploy.block_tokens
        if not self.router.uses_holdings:
            return [ReplicaStatus(i, in_flight=n, assigned=n) for i, n in enumerate(loads)]
        ids, most = request.hash_ids, request.input_len
        return [ReplicaStatus(i, in_flight=n, assigned=n,
                              cached_tokens=min(self.stores[i].prefix(ids, True) * block, most),
                              stored_tokens=min(self.stores[i].prefix(ids, False) * block, most))
                for i, n in enumerate(loads)]

    def _arrive(self, request: SimRequest) -> None:
        block = self.deploy.block_tokens
        prompt = RoutingRequest(str(request.index), TracePrompt(request.hash_ids, request.input_len, block))
        if self.workers:
            self._arrive_colocated(request, prompt)
            return
        d = self.router.route("decode", prompt, self._statuses(self.decodes))
        stores = self._holdings(request, self.store_load)
        if self.network is not None and self.network.paired:  # the store first, then the prefill beside it
            stores = [st for st in stores if self.prefills[st.replica].routable(self.now)]
            s = p = self.router.route("kv_shuttle", prompt, stores)
        else:
            p = self.router.route("prefill", prompt, self._statuses(self.prefills))
            s = self.router.route("kv_shuttle", prompt, stores)
        holder = self.router.fetch_from("kv_shuttle", prompt, s, stores)
        request.route = (p, s, d)
        store = self.stores[s]
        reusable = (request.input_len - 1) // block  # whole blocks, never the last token
        own = min(store.prefix(request.hash_ids, False), reusable)
        fetched = 0
        if holder is not None and holder != s:
            fetched = max(0, min(self.stores[holder].prefix(request.hash_ids, False), reusable) - own)
            self.stores[holder].touch(request.hash_ids[own:own + fetched])
        store.touch(request.hash_ids[:own])
        request.cached_tokens, request.fetched_tokens = (own + fetched) * block, fetched * block
        if fetched and self.network is not None:
            self.network.fetched(holder, s, fetched * block * self.profile.kv_bytes_per_token)
        store.expect(request.hash_ids, 1)
        self.store_load[s] += 1
        self.prefills[p].assigned += 1
        self.decodes[d].assigned += 1
        fetch_s = fetched * block * self.profile.kv_bytes_per_token / self._fetch_rate if fetched else 0.0
        self._at(self.now + fetch_s, self._enqueue, request)

    # --- prefill ----------------------------------------------------------------------------

    def _enqueue(self, request: SimRequest) -> None:
        replica = self.prefills[request.route[0]]
        if request.cached_tokens and self.network is not None:  # from a store host, or the one beside it
            hops = self.network.prefix_hops(replica.number, request.route[1],
                                            request.cached_tokens * self.profile.kv_bytes_per_token)
            request.prefix_in_s = self.network.stream(hops, self.now, self.now) if hops else self.now
        elif request.cached_tokens:  # the store sends the prefix now; it lands while the request waits
            request.prefix_in_s = self.now + self.profile.link_latency_s + self._link_s(request.cached_tokens)
        replica.queue.append(request)
        if not replica.busy:
            self._next_prefill(replica)

    def _next_prefill(self, replica: _Prefill) -> None:
        was = replica.busy
        replica.busy = bool(replica.queue)
        if self._drawn and replica.busy != was and replica.number < len(self.decodes):
            self._cut(self.decodes[replica.number])  # the steps after this draw from the other ratios
        if not replica.queue:
            return
        request = replica.queue.popleft()
        new = request.input_len - request.cached_tokens
        seconds = self.profile.prefill_s(new, request.cached_tokens)
        if request.cached_tokens:  # layer l computes once its prefix's layer l is in (as prefill does)
            layers, sent_at = self.profile.layers, request.prefix_in_s - self.now
            whole = self._link_s(request.cached_tokens)
            first_in = sent_at - whole + whole / layers  # (sent_at: when the last layer is in, from now)
            seconds = max(seconds, first_in + seconds, sent_at + seconds / layers)
        self._at(self.now + seconds, self._prefilled, replica, request, seconds)

    def _prefilled(self, replica: _Prefill, request: SimRequest, seconds: float) -> None:
        replica.assigned -= 1
        store = self.stores[request.route[1]]
        store.expect(request.hash_ids, -1)
        store.touch(request.hash_ids)
        self.store_load[request.route[1]] -= 1
        self._first_token(request, self.now)
        decode = self.decodes[request.route[2]]
        if request.output_len <= 1:  # done with its first token: its KV goes to the store only
            self._kv_tail(replica, None, request, seconds)
            self._finish(decode, request)
        else:
            self._at(self.now + self._kv_tail(replica, decode, request, seconds), self._kv_in, request)
        self._next_prefill(replica)

    def _link_s(self, tokens: int) -> float:
        """How long ``tokens`` tokens' KV take on a link (its latency aside)."""
        return tokens * self.profile.kv_bytes_per_token / self._link_rate

    def _kv_tail(self, prefill: _Prefill, decode: _Decode | None, request: SimRequest, seconds: float) -> float:
        """From prefill's end until decode holds all of ``request``'s KV. Prefill's link carries
        the KV it computed (the new tokens'), decode's link all of it (the store sends the cached
        prefix); each link one transfer after another. Layer-streamed, prefill's may start once
        the first layer is computed and its link is free, and ends no sooner than the last
        layer's own send after prefill ends; whole, it starts once prefill ends. Decode's starts
        with it (or once decode's link is free) and ends no sooner than it. Without ``decode``
        (a request done at prefill) only prefill's link carries it, and the tail is its send."""
        if self.network is not None:
            return self._kv_tail_on_network(prefill, decode, request, seconds)
        layers = self.profile.layers
        computed, every = self._link_s(request.input_len - request.cached_tokens), self._link_s(request.input_len)
        if self.deploy.kv_streaming == "layer":
            start = max(self.now - seconds + seconds / layers, prefill.link_free_s)
            sent = max(self.now + computed / layers, start + computed)
        else:
            start = max(self.now, prefill.link_free_s)
            sent = start + computed
        prefill.link_free_s = sent
        if decode is None:
            return sent + self.profile.link_latency_s - self.now
        received = max(sent, max(start, decode.link_free_s) + every)
        decode.link_free_s = received
        return received + self.profile.link_latency_s - self.now

    def _kv_tail_on_network(self, prefill: _Prefill, decode: _Decode | None, request: SimRequest,
                            seconds: float) -> float:
        """As :meth:`_kv_tail`, over the hosts' NICs of the deployment's placement."""
        per_token = self.profile.kv_bytes_per_token
        hops = self.network.kv_hops(prefill.number, request.route[1], None if decode is None else decode.number,
                                    (request.input_len - request.cached_tokens) * per_token,
                                    request.input_len * per_token)
        if not hops:  # its KV stays on prefill's host
            return 0.0
        if self.deploy.kv_streaming == "layer":
            first, layers = hops[0], self.profile.layers
            start, floor = self.now - seconds + seconds / layers, self.now + first[2] / first[0].rate / layers
        else:
            start = floor = self.now
        return self.network.stream(hops, start, floor) - self.now

    # --- decode -----------------------------------------------------------------------------

    def _kv_in(self, request: SimRequest) -> None:
        request.kv_in_s = self.now
        replica = self.decodes[request.route[2]]
        replica.waiting.append(request)
        if not replica.running:
            self._tick(replica, replica.version)
        else:
            self._cut(replica)  # joins at the next step boundary

    def _step_end(self, replica: _Decode, steps: int) -> float:
        """When the ``steps``-th step of the planned run ends."""
        if replica.ratios is None:
            return replica.run_start + steps * replica.step_s
        return replica.run_start + (replica.ends[steps - 1] if steps else 0.0)

    def _cut(self, replica: _Decode | _Worker) -> None:
        """End ``replica``'s run at its next step boundary, where a tick (a worker: an
        iteration) plans anew."""
        if not replica.steps:  # idle, or a tick at a boundary is already coming
            return
        elapsed = self.now - replica.run_start
        if replica.ratios is None:
            done = math.floor(elapsed / replica.step_s + 1e-9)
        else:
            done = bisect.bisect_right(replica.ends, elapsed + 1e-9)
        if done < replica.steps:  # (else the run's own end is due now, and plans anew)
            replica.version += 1
            boundary = self._step_end(replica, done + 1)
            self._advance(replica, done + 1, boundary)
            replica.steps = 0  # a tick at the boundary is coming: later arrivals wait for it
            then = self._iterate if isinstance(replica, _Worker) else self._tick
            self._at(boundary, then, replica, replica.version)

    def _advance(self, replica: _Decode | _Worker, steps: int, until: float) -> None:
        """Account ``steps`` steps of the running batch (ending at ``until``): tokens and gaps
        (a sequence's first step here also covers what came between its last token and the run's
        start: for one that just joined, its KV tail and the wait for the step boundary)."""
        if steps <= 0:
            return
        if replica.ratios is None:
            gaps = [replica.step_s] * steps
        else:
            gaps = [ratio * replica.step_s for ratio in replica.ratios[:steps]]
            base = replica.ends[steps - 1]
            replica.ratios, replica.ends = replica.ratios[steps:], [end - base for end in replica.ends[steps:]]
        for seq in replica.running:
            seq.request.gaps.append(replica.run_start + gaps[0] - seq.last_s)
            seq.request.gaps.extend(gaps[1:])
            seq.left -= steps
            seq.context += steps
            seq.last_s = until
        self.recent_tbt.append((until, sum(gaps) / steps))
        replica.run_start, replica.steps = until, max(0, replica.steps - steps)

    def _plan(self, replica: _Decode | _Worker, steps: int) -> float:
        """Draw the run's steps' ratios (with the profile's gap ratios; a worker's decode-only
        run: with its step extras); the run's length."""
        if isinstance(replica, _Worker):
            batch = len(replica.running)
            draw = (lambda: self._worker_step_ratio(batch, replica.step_s)) if self._worker_extras else None
        elif self._drawn:
            beside = self.prefills[replica.number] if replica.number < len(self.prefills) else None
            busy = beside is not None and beside.busy
            draw = lambda: self.profile.gap_ratio(busy, self.rng.random())  # noqa: E731
        else:
            draw = None
        if draw is None:
            replica.ratios = None
            return steps * replica.step_s
        replica.ratios = [draw() for _ in range(steps)]
        replica.ends = list(itertools.accumulate(ratio * replica.step_s for ratio in replica.ratios))
        return replica.ends[-1]

    def _tick(self, replica: _Decode, version: int) -> None:
        """The end of a run: apply its remaining steps, end what finished, admit, plan the next."""
        if version != replica.version:
            return
        if replica.running:
            self._advance(replica, replica.steps, self._step_end(replica, replica.steps))
            self._end_finished(replica)
        room = self.profile.max_batch - len(replica.running)
        while replica.waiting and room > 0:
            request = replica.waiting.popleft()
            room -= 1
            replica.running.append(_Seq(request, request.output_len - 1, request.input_len + 1, request.first_token_s))
        replica.version += 1
        if replica.running:
            steps = min(seq.left for seq in replica.running)
            mean_context = sum(seq.context for seq in replica.running) / len(replica.running) + steps / 2
            replica.step_s = self.profile.decode_step_s(len(replica.running), mean_context)
            replica.run_start, replica.steps = self.now, steps
            self._at(self.now + self._plan(replica, steps), self._tick, replica, replica.version)

    def _end_finished(self, replica: _Decode | _Worker) -> None:
        """Take the sequences whose last token is out of ``replica``'s batch."""
        still = []
        for seq in replica.running:
            if seq.left <= 0:
                self._finish(replica, seq.request)
            else:
                still.append(seq)
        replica.running = still

    def _finish(self, replica: _Replica, request: SimRequest, at: float | None = None) -> None:
        request.done_s = self.now if at is None else at
        replica.assigned -= 1
        self.finished.append(request)

    # --- colocated workers ------------------------------------------------------------------

    def _arrive_colocated(self, request: SimRequest, prompt: RoutingRequest) -> None:
        statuses = [s for s in self._holdings(request, [w.assigned for w in self.workers])]
        w = self.workers[self.router.route("worker", prompt, statuses)]
        request.route = (w.number, w.number, w.number)
        w.store.expect(request.hash_ids, 1)
        w.assigned += 1
        w.waiting.append(request)
        if not w.busy:
            self._iterate(w, w.version)
        elif w.steps:  # a decode-only run: cut at the next step boundary, where an iteration starts
            self._cut(w)
        # else: in an iteration's prefill work, which reads the queue as it goes (it is taken
        # there), or in its decode step (the next iteration takes it)

    def _iterate(self, w: _Worker, version: int) -> None:
        """The start of a pass of the worker's loop at ``now``: end what finished, then the
        prefill work (:meth:`_prefill_work`) and a decode step (:meth:`_decode_step`)."""
        if version != w.version:
            return
        w.version += 1
        if w.steps:  # the end of a decode-only run
            self._advance(w, w.steps, self._step_end(w, w.steps))
        self._end_finished(w)
        w.busy = True
        w.budget = self.deploy.chunked_prefill_tokens or None
        w.ratio = self.profile.worker_ratio(self.rng.random()) if self._worker_ratios else 1.0
        w.prefilling_now = False
        self._prefill_work(w, w.version)

    def _prefill_work(self, w: _Worker, version: int) -> None:
        """The iteration's prefill work, one prompt (or chunk) per event. As the worker's loop, it
        takes the queue's head while the batch has room and the budget lasts, prompts that arrive
        meanwhile included; a prompt's cached prefix is looked up as it starts, its blocks stored
        as it ends. Then :meth:`_decode_step`."""
        if version != w.version:
            return
        if w.finishing is not None:  # its prefill ended now
            request, w.finishing = w.finishing, None
            w.store.expect(request.hash_ids, -1)
            w.store.touch(request.hash_ids)
            w.prefilled_now.append(request)
        if not (w.waiting and (w.budget is None or w.budget > 0)
                and len(w.running) + len(w.prefilled_now) < self.profile.max_batch):
            self._decode_step(w)
            return
        request, block = w.waiting[0], self.deploy.block_tokens
        if w.prefilled == 0:
            own = min(w.store.prefix(request.hash_ids, False), (request.input_len - 1) // block)
            w.store.touch(request.hash_ids[:own])
            request.cached_tokens = own * block
        cached, new = request.cached_tokens, request.input_len - request.cached_tokens
        k = new - w.prefilled if w.budget is None else min(w.budget, new - w.prefilled)
        seconds = self.profile.prefill_s(k, cached + w.prefilled)
        if w.prefilled:  # a later chunk of a prompt: one forward pass's overhead was paid by the first
            seconds -= self.profile.prefill_overhead_s
        seconds *= w.ratio
        w.prefilling_now = True
        w.prefilled += k
        if w.budget is not None:
            w.budget -= k
        if w.prefilled >= new:
            w.waiting.popleft()
            w.prefilled, w.finishing = 0, request
        self._at(self.now + max(0.0, seconds), self._prefill_work, w, w.version)

    def _decode_step(self, w: _Worker) -> None:
        """The iteration's decode step, for the batch and the prompts just prefilled (they join
        it); as the worker, it sends their first tokens once the step is done, with the step's
        (their second: no gap between them). With nothing prefilled and nothing waiting, a run of
        steps up to the next sequence's end instead, cut if a prompt arrives."""
        t, joined = self.now, w.prefilled_now
        w.prefilled_now = []
        new = [_Seq(r, r.output_len - 1, r.input_len + 1) for r in joined if r.output_len > 1]
        w.running.extend(new)
        if not w.running:  # nothing to step: the iteration ends now
            for request in joined:
                self._first_token(request, t)
                self._finish(w, request, t)
            w.busy = bool(w.waiting)  # (a chunk budget spent: the next iteration goes on with it)
            if w.busy:
                self._at(t, self._iterate, w, w.version)
            return
        mean_context = sum(seq.context for seq in w.running) / len(w.running)
        step_s = self.profile.decode_step_s(len(w.running), mean_context)
        if joined or w.waiting:  # one step, then the next iteration
            if w.prefilling_now and self._worker_ratios:  # the iteration's ratio where it prefilled
                step_s *= w.ratio
            elif self._worker_extras:  # else a step alone's extra
                step_s *= self._worker_step_ratio(len(w.running), step_s)
            w.run_start, w.step_s, w.ratios = t, step_s, None
            for seq in new:
                seq.last_s = t + step_s
            for request in joined:
                self._first_token(request, t + step_s)
                if request.output_len <= 1:
                    self._finish(w, request, t + step_s)
            self._advance(w, 1, t + step_s)
            self._at(t + step_s, self._iterate, w, w.version)
        else:  # nothing to prefill: steps up to the next end, cut if a prompt arrives
            steps = min(seq.left for seq in w.running)
            w.run_start = t
            w.step_s = self.profile.decode_step_s(len(w.running), mean_context + steps / 2)
            w.steps = steps
            self._at(t + self._plan(w, steps), self._iterate, w, w.version)

    def _worker_step_ratio(self, batch: int, step_s: float) -> float:
        """A worker's step alone of ``batch`` sequences with a drawn extra
        (:meth:`Profile.worker_step_extra`) over the bare ``step_s``."""
        extra = self.profile.worker_step_extra(batch, self.rng.random())
        return max(1e-6, step_s + extra) / step_s

    def _first_token(self, request: SimRequest, at: float) -> None:
        request.first_token_s = at
        self.recent_ttft.append((at, at - request.arrival_s))

    # --- the scaler -------------------------------------------------------------------------

    def _scale(self, interval_s: float) -> None:
        from pdflow.runtime.scaler import Load, StageLoad

        now = self.now
        self._settle_drains()
        window = self.scaler.config.window_s
        for recent in (self.recent_ttft, self.recent_tbt):
            while recent and recent[0][0] < now - window:
                recent.popleft()
        d = self.deploy
        stages = {}
        for name, kind, replicas, floor in (("prefill", "prefill", self.prefills, d.min_prefill),
                                            ("decode", "decode", self.decodes, d.min_decode)):
            if floor is None:
                continue
            running = [r for r in replicas if not r.parked and not r.draining]
            work = sum(len(r.queue) + r.busy for r in running) if kind == "prefill" else \
                sum(len(r.running) for r in running)
            stages[name] = StageLoad(kind, len(running), work, floor, len(replicas))
        load = Load(stages, _p90(self.recent_ttft), _p90(self.recent_tbt))
        for stage, (step, _why) in self.scaler.decide(load, now).items():
            replicas = self.prefills if stage == "prefill" else self.decodes
            if step > 0:
                parked = [r for r in replicas if r.parked]
                if parked:
                    parked[0].parked, parked[0].ready_at = False, now + self.profile.replica_start_s
            else:
                candidates = [r for r in replicas if not r.parked and not r.draining and r.routable(now)]
                if len(candidates) > 1:
                    min(candidates, key=lambda r: (r.assigned, -r.number)).draining = True
        self._log_replicas()
        self._at(now + interval_s, self._scale, interval_s)

    def _settle_drains(self) -> None:
        for replica in (*self.prefills, *self.decodes):
            if replica.draining and replica.assigned == 0:
                replica.draining, replica.parked = False, True

    def _log_replicas(self) -> None:
        self.replica_log.append((self.now, sum(not r.parked for r in self.prefills),
                                 sum(not r.parked for r in self.decodes)))


def _p90(recent: deque[tuple[float, float]]) -> float | None:
    if not recent:
        return None
    values = sorted(v for _, v in recent)
    return values[min(len(values) - 1, int(0.9 * len(values)))]
