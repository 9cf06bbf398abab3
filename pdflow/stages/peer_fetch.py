"""Mixed into kv-shuttle: a prompt's prefix fetched from another replica's store, and one served to it.

With several replicas, ingress may name another one that holds more of the prompt's prefix
(``Route.fetch_from``, cache-aware routing): before its lease, the store leases slots for the
blocks it lacks (a :attr:`~pdflow.kv.lease_owner.LeaseKind.FETCH` lease) and asks that replica
(``KvFetch``) to write them there; they are committed once all their layers are in and the holder
says how many it wrote (``KvFetched``), and the request then reads them as its own cached prefix.
A holder that lacks them, a write that fails or no answer in time (:func:`_fetch_timeout_s`): the
blocks not fetched are computed, and slots a late write could still reach are quarantined
(:data:`~pdflow.messages.LATE_WRITES_S`).

The holder leases what it has of them (a :attr:`~pdflow.kv.lease_owner.LeaseKind.SERVE` lease,
checksums verified) while it writes them slot to slot into the asker's arena, over the transport
of the link from decode into kv-shuttle's arena, which crosses hosts (blocks travel as the store
holds them, encoded or not).

The stage provides its ``store``, ``arena`` (registered as ``arena_region`` at
``answers_address``, where decode's answers land too),
``memory`` (the arena's bytes), ``kv``, ``hasher``, ``reuse``, ``_blocks_of`` and the
:class:`~pdflow.runtime.stage.Stage` API, and calls :meth:`PeerFetch.setup_peer_fetch` in its setup.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdflow import transports
from pdflow.kv.arena import ArenaLayout
from pdflow.kv.chunks import between_slots
from pdflow.kv.layout import KEYS, VALUES
from pdflow.kv.lease_owner import LeaseKind, LeaseOwner
from pdflow.kv.store import Lease, StoreFull
from pdflow.messages import LATE_WRITES_S, KvExpected, KvFetch, KvFetched
from pdflow.transports import ChunkNotice

_FETCH_WAIT_S = 1.0  # a prefix fetched from another store is given up after this long, plus its bytes at:
_FETCH_SLOWEST_BYTES_PER_S = 50e6  # (a link slower than this between stores loses fetches to the timeout)


def _fetch_timeout_s(nbytes: int) -> float:
    return _FETCH_WAIT_S + nbytes / _FETCH_SLOWEST_BYTES_PER_S


@dataclass(slots=True, eq=False)
class _Fetch:
    """Blocks of a prompt's prefix on their way from another replica's store into slots here."""

    lease: Lease  # a LeaseKind.FETCH lease: the prefix this store holds, slots for the rest
    peer: int  # the replica they come from
    landed: list[int]  # per block asked for (from the lease's hit): layer spans landed
    done: asyncio.Future  # -> blocks fetched (0: none, or failed)
    answered: int | None = None  # blocks the peer says it wrote
    failed: bool = False  # a chunk was lost: what landed is not trusted


class PeerFetch:
    """Fetching prefixes from other replicas' stores, and serving theirs (see the module doc)."""

    def setup_peer_fetch(self) -> None:
        self.fetches: dict[str, _Fetch] = {}  # by the chunks' request id: prefixes coming from another store
        self.fetch_counts = dict.fromkeys(("peer_fetches", "peer_fetched_blocks", "peer_fetches_failed",
                                           "peer_served", "peer_served_blocks"), 0)
        self.to_peers = None  # the data plane into other replicas' stores (made when first needed)

    async def close_peer_fetch(self) -> None:
        if self.to_peers is not None:
            await self.to_peers.aclose()

    def peer_fetch_stats(self) -> dict[str, int]:
        """Fetches asked and served, with their blocks, and the bytes sent into other replicas' stores."""
        stats = dict(self.fetch_counts)
        if self.to_peers is not None:
            peer = self.pipeline.stages[self.ctx.stage].display_name
            stats[f"kv_sent_bytes@{peer}"] = self.to_peers.sent_bytes
            stats[f"kv_network_bytes@{peer}"] = self.network_bytes(self.to_peers)
        return stats

    def fetch_peer(self, request: KvExpected) -> int | None:
        """The replica of this stage that ingress says holds more of the prompt's prefix, if any."""
        peer = request.route.fetch_from.get(self.ctx.stage) if self.reuse and request.reuse_prefix else None
        replicas = self.pipeline.stages[self.ctx.stage].replicas
        return peer if isinstance(peer, int) and 0 <= peer < replicas and peer != self.replica else None

    async def fetch_from_peer(self, request: KvExpected, ids: list, usable: int) -> bool:
        """Have the replica ingress named write the blocks of the prompt's first ``usable`` this
        store lacks into slots leased here, and commit those it wrote. True: a
        :attr:`~pdflow.kv.lease_owner.LeaseKind.FETCH` lease holds the prefix now (to be released
        once the request's own lease holds it)."""
        peer = self.fetch_peer(request)
        rid = request.request_id
        owner = LeaseOwner(rid, LeaseKind.FETCH)
        if peer is None:
            return False
        try:
            lease = self.store.lease(owner, ids[:usable], verify=False, count=False,
                                     keep_s=request.keep_s)
        except StoreFull:
            return False
        if lease.hit >= usable:
            return True
        fetch_id, bt, wanted = f"{rid}:fetch", self.arena.block_tokens, usable - lease.hit
        fetch = self.fetches[fetch_id] = _Fetch(lease, peer, [0] * wanted, asyncio.get_running_loop().create_future())
        self.fetch_counts["peer_fetches"] += 1
        began, blocks = time.monotonic(), 0
        try:
            await self.bus.send(self.ctx.stage, peer, KvFetch(
                fetch_id, self.ctx.stage, self.replica, request.prompt_ids[: usable * bt], lease.hit,
                self.answers_address, self.arena_region, self.arena.num_slots, lease.slots[lease.hit : usable]))
            blocks = await asyncio.wait_for(asyncio.shield(fetch.done), _fetch_timeout_s(wanted * self.arena.block_bytes))
        except asyncio.TimeoutError:
            fetch.failed = True
        except BaseException:  # cancelled: a write may still land in these slots
            self.store.release(owner, LATE_WRITES_S)
            raise
        finally:
            self.fetches.pop(fetch_id, None)
        if fetch.failed:  # nothing of it is trusted, and a late write may still land
            self.fetch_counts["peer_fetches_failed"] += 1
            self.store.release(owner, LATE_WRITES_S)
            self.log.warning("store.fetch_failed", request_id=rid, peer=peer, blocks=wanted,
                             ms=round(1000 * (time.monotonic() - began), 1))
            return False
        for i in range(lease.hit, lease.hit + blocks):
            self.store.commit(lease, i)
        self.fetch_counts["peer_fetched_blocks"] += blocks
        self.log.info("store.fetched", request_id=rid, peer=peer, blocks=blocks, of=wanted,
                      bytes=blocks * self.arena.block_bytes, ms=round(1000 * (time.monotonic() - began), 2))
        return True

    def fetched_chunk_landed(self, notice: ChunkNotice) -> bool:
        """Count a chunk that landed for a fetch of this store's (False: it is not one)."""
        fetch = self.fetches.get(notice.header.request_id) if self.fetches else None
        if fetch is None:
            return False
        if notice.error is not None:
            fetch.failed = True
        else:
            for i in self._blocks_of(notice.header, fetch.lease.hit):
                if 0 <= i < len(fetch.landed):
                    fetch.landed[i] += 1
        self._fetch_progress(fetch)
        return True

    def on_fetched(self, message: KvFetched) -> None:
        fetch = self.fetches.get(message.fetch_id)
        if fetch is None or message.stage != self.ctx.stage or message.replica != fetch.peer:
            return  # given up already, or not from the replica asked
        fetch.answered = max(0, min(message.blocks, len(fetch.landed)))
        self._fetch_progress(fetch)

    def _fetch_progress(self, fetch: _Fetch) -> None:
        """Done once the peer has answered and every layer of the blocks it wrote is in."""
        if fetch.done.done():
            return
        if fetch.failed:
            fetch.done.set_result(0)
        elif fetch.answered is not None and all(n >= 2 * self.kv.num_layers for n in fetch.landed[: fetch.answered]):
            fetch.done.set_result(fetch.answered)

    def on_fetch(self, message: KvFetch) -> None:
        """Another replica asks for blocks of a prefix this store holds (see :meth:`fetch_from_peer`)."""
        replicas = self.pipeline.stages[self.ctx.stage].replicas
        if message.stage != self.ctx.stage or not 0 <= message.replica < replicas or message.replica == self.replica:
            return
        self.spawn(self._serve_fetch(message))

    async def _serve_fetch(self, message: KvFetch) -> None:
        """Write the blocks asked for that this store holds (leased meanwhile) into the asker's
        slots, then say how many."""
        bt, first, owner = self.arena.block_tokens, message.first_block, LeaseOwner(message.fetch_id, LeaseKind.SERVE)
        ids = self.hasher.ids(message.prompt_ids) if self.reuse else []
        sent, lease = 0, None
        if 0 <= first < len(ids) and len(message.slots) >= len(ids) - first and message.num_slots > 0 \
                and all(0 <= slot < message.num_slots for slot in message.slots):
            try:
                lease = self.store.lease(owner, ids, verify=True, count=False, write=False)
            except (StoreFull, ValueError):
                lease = None
        try:
            if lease is not None and lease.hit > first:
                dst = ArenaLayout(self.kv, bt, message.num_slots, self.arena.codec)
                dst_slots = [-1] * first + list(message.slots[: lease.hit - first])
                self.to_peers = self.to_peers or self._peer_sender()
                for layer in range(self.kv.num_layers):
                    for header, data in between_slots(message.fetch_id, self.arena, self.memory, layer, (KEYS, VALUES),
                                                      lease.slots[first : lease.hit], first * bt, lease.hit * bt, dst,
                                                      dst_slots, message.region):
                        await self.to_peers.write(message.address, header, data)
                sent = lease.hit - first
        except (transports.TransportError, ValueError) as exc:
            sent = 0
            self.log.warning("store.fetch_serve_failed", asker=message.replica, error=repr(exc))
        finally:
            if lease is not None:
                self.store.release(owner)
        self.fetch_counts["peer_served"] += 1
        self.fetch_counts["peer_served_blocks"] += sent
        await self.bus.send(self.ctx.stage, message.replica, KvFetched(message.fetch_id, self.ctx.stage, self.replica,
                                                                       sent))

    def _peer_sender(self):
        """A data-plane transport into other replicas' arenas: the transport (and options) of the
        link their arenas receive decode's answers on (the one that crosses hosts, where prefill's
        is shm), without a codec (blocks travel as the store holds them)."""
        link = self.pipeline.link(self.output("kv"), self.ctx.stage)
        transport = transports.create(link.transport, host=self.config.bind_host_of(self.replica), **link.options)
        transport.authenticate(self.data_key)
        return transport
