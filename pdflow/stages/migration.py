"""Request migration: when a replica on a request's route dies mid-request, ingress submits the
request again on live replicas instead of failing it, as Dynamo does.

The request is cancelled everywhere under its old internal id and admitted under a new one
(``<id>~1``, ``~2``): its prompt followed by every token generated so far (which ingress learns
from ``TextDelta.token_ids``), with ``max_tokens`` less those. The prefix store makes the
re-prefill of what was already computed cheap. The new attempt's text stream (ingress's, or an
egress stage's from ``EgressRequest.resume_ids`` / ``resume_chars``) gets the generated tokens and
how much text the client has, rebuilds its detokenizer and stop-string state from them and sends
only what is new: the client sees one uninterrupted stream
with the same ``id``, no text repeated or missing, and usage counted once.

A failure report (``RequestFailed``) that a replica's death causes can come before the launcher's
``StageDown``; ingress waits :data:`FAILURE_GRACE_S` to see whether a replica on the route went
down before it decides between migrating and failing. A *transient* failure (the request's KV
lost or damaged on the data plane: a checksum mismatch, a broken connection) is run again the
same way at once, on the same replicas if they are well. A request migrates at most
``limits.max_migrations`` times, and waits for a live replica of every stage only until its own
deadline. Greedy requests continue exactly as they would have (up to float rounding at a
near-tie); a seeded sampled request continues with a fresh generator of the same seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec

from pdflow.messages import Cancel, RequestFailed, TextDelta
from pdflow.serving.openai_protocol import ApiError

FAILURE_GRACE_S = 1.0
_ROUTE_POLL_S = 0.25


class MigratingIngress:
    """Mixed into ingress: what migration adds to it (see the module doc)."""

    migrations = 0

    def stats(self) -> dict[str, int]:
        return {"migrations": self.migrations}

    def may_migrate(self, pending) -> bool:
        return (pending is not None and pending.submission is not None and not pending.migrating
                and pending.attempts < self.limits.max_migrations and self.accepting)

    def _route_down(self, pending) -> bool:
        return any((name, pending.route.of(name)) in self.down for name in self.routed)

    async def failed_or_migrated(self, pending, failure: RequestFailed) -> None:
        """A stage reported ``failure``: run the request again if the failure was transient (KV
        lost or damaged on the data plane) or a replica on the route went down meanwhile, else
        fail it as reported."""
        internal_id = pending.internal_id
        await asyncio.sleep(0.0 if failure.transient else FAILURE_GRACE_S)
        if pending.internal_id != internal_id or pending.migrating:
            return  # StageDown came and migrated it already
        if (failure.transient or self._route_down(pending)) and self.may_migrate(pending):
            await self.migrate(pending, failure.message)
        else:
            pending.queue.put_nowait(failure)

    async def migrate(self, pending, reason: str) -> None:
        try:
            await self._migrate(pending, reason)
        except Exception as exc:  # whatever went wrong, the client gets an error, never a hang
            self.log.exception("request.migration_crashed", request_id=pending.request_id)
            self._give_up(pending, f"{reason}; migrating it failed: {exc!r}")

    async def _migrate(self, pending, reason: str) -> None:
        pending.migrating = True
        old_id, old_route = pending.internal_id, pending.route
        self.requests.end(old_id)  # late messages for the old attempt are dropped from now on
        self.assigned.subtract(old_route.replicas.items())
        if self.holdings is not None:
            self.holdings.settle(old_id)
        for name in self.routed:
            self.spawn(self.bus.send(name, old_route.of(name), Cancel(old_id, "migrated")))
        original = pending.submission
        generated = list(pending.generated)
        remaining = original.sampling.max_tokens - len(generated)
        new_id = f"{pending.request_id}~{pending.attempts + 1}"
        prompt_ids = list(original.prompt_ids) + generated
        deadline = pending.received + self.limits.request_timeout_s
        route = None
        while route is None:
            try:
                route = self._route(new_id, prompt_ids)
            except ApiError:
                if time.monotonic() > deadline or not self.accepting:
                    self._give_up(pending, f"{reason}; no replica came back to take the request over")
                    return
                await asyncio.sleep(_ROUTE_POLL_S)
        if pending.abandoned:  # the client went away while it waited
            pending.migrating = False
            return
        if remaining <= 0:  # it had every token: only its finish was lost
            pending.queue.put_nowait(TextDelta(new_id, "", len(generated), "length"))
            pending.migrating = False
            return
        submission = dataclasses.replace(
            original, request_id=new_id, prompt_ids=prompt_ids, route=route,
            sampling=msgspec.structs.replace(original.sampling, max_tokens=remaining),
            resume_ids=tuple(generated), resume_chars=pending.sent_chars)
        pending.internal_id, pending.route, pending.attempts = new_id, route, pending.attempts + 1
        self.requests.open(new_id, pending)
        self.assigned.update(route.replicas.items())
        self.migrations += 1
        self.log.warning("request.migrated", request_id=pending.request_id, attempt=pending.attempts,
                         generated=len(generated), reason=reason)
        try:
            await self.admit(submission)
        except Exception as exc:
            self._give_up(pending, f"{reason}; resubmitting failed: {exc!r}")
            return
        finally:
            pending.migrating = False

    def _give_up(self, pending, error: str) -> None:
        pending.migrating = False
        pending.queue.put_nowait(RequestFailed(pending.request_id, "ingress", error))
        self.log.error("request.migration_failed", request_id=pending.request_id, error=error)
