"""Forgetting KV on demand: ingress's side of ``POST /admin/kv/forget``.

Ingress sends :class:`~pdflow.messages.KvForget` to every replica of every stage that keeps KV
(``Stage.holds_kv``: kv-shuttle, the colocated worker) and waits for each one's
:class:`~pdflow.messages.KvForgotten`. The answer says what each replica dropped and which ones did
not answer in time (down, restarting): a caller who must be sure their KV is gone retries until
none is missing. A replica that restarts keeps its disk tier, so one that missed a forget still
holds what it held.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from pdflow.messages import KvForget, KvForgotten

FORGET_TIMEOUT_S = 10.0


@dataclass(slots=True, eq=False)
class _Forgetting:
    waiting: set[str]
    done: asyncio.Future
    replies: dict[str, dict[str, int]] = field(default_factory=dict)


class KvAdminIngress:
    """Mixed into ingress: drop KV everywhere it is kept (in ingress's ``keeps_kv``; see the module doc)."""

    def kv_holders(self) -> list[tuple[str, int]]:
        return [(name, i) for name, i in self.pipeline.replicas() if name in self.keeps_kv]

    async def forget_kv(self, prompt_ids: list[int] | None, timeout_s: float = FORGET_TIMEOUT_S) -> dict:
        """Drop the KV of ``prompt_ids``'s prefix and all built on it (None: everything) in every
        store; per replica what went, and the replicas that did not answer within ``timeout_s``."""
        holders = self.kv_holders()
        names = {f"{self.pipeline.stages[name].display_name}-{i}": (name, i) for name, i in holders}
        forget_id = uuid.uuid4().hex
        forgetting = _Forgetting(set(names), asyncio.get_running_loop().create_future())
        if not hasattr(self, "_forgetting"):
            self._forgetting: dict[str, _Forgetting] = {}
        self._forgetting[forget_id] = forgetting
        message = KvForget(forget_id, list(prompt_ids or ()), everything=prompt_ids is None)
        try:
            for name, i in holders:
                await self.bus.send(name, i, message)
            if names:
                await asyncio.wait_for(asyncio.shield(forgetting.done), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._forgetting.pop(forget_id, None)
        return {"replicas": forgetting.replies, "unreached": sorted(forgetting.waiting)}

    def on_forgotten(self, message: KvForgotten) -> None:
        forgetting = getattr(self, "_forgetting", {}).get(message.forget_id)
        if forgetting is None or message.stage not in self.pipeline.stages:
            return
        name = f"{self.pipeline.stages[message.stage].display_name}-{message.replica}"
        if name not in forgetting.waiting:
            return
        forgetting.waiting.discard(name)
        forgetting.replies[name] = {"memory_blocks": message.memory_blocks, "disk_blocks": message.disk_blocks}
        if not forgetting.waiting and not forgetting.done.done():
            forgetting.done.set_result(None)
