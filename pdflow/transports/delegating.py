"""A transport that is another one with something added: every method goes to ``inner``.

The wrappers of the data plane (an emulated link, :mod:`pdflow.transports.shaping`; KV codecs,
:mod:`pdflow.kv.coded`) subclass :class:`DelegatingTransport` and override only what they add
to; regions, notices, links and state stay the inner transport's.
"""

from __future__ import annotations

from typing import Any

from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport
from pdflow.transports.errors import ChunkNotice

__all__ = ["DelegatingTransport"]


class DelegatingTransport(Transport):
    """``inner``, unchanged; subclasses override what they add to."""

    def __init__(self, inner: Transport) -> None:
        # Transport.__init__ is not called on purpose: regions, notices and state are inner's.
        self.inner = inner
        self.cross_process = inner.cross_process  # type: ignore[misc]
        self.shares_memory = inner.shares_memory  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:  # name, host, port, options, proof_key, transport extras
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def copy_counts(self) -> dict[str, int] | None:  # type: ignore[override]
        return self.inner.copy_counts

    @property
    def sent_bytes(self) -> int:  # type: ignore[override]
        return self.inner.sent_bytes

    def sent_by_peer(self) -> dict[str, int]:
        return self.inner.sent_by_peer()

    @property
    def address(self) -> str:
        return self.inner.address

    def authenticate(self, key: bytes | None) -> None:
        self.inner.authenticate(key)

    def advertise(self, host: str) -> None:
        self.inner.advertise(host)

    async def start(self) -> None:
        await self.inner.start()

    def register(self, region: int, buffer: Any) -> None:
        self.inner.register(region, buffer)

    def memory_kinds(self):
        return self.inner.memory_kinds()

    def allocate(self, region: int, nbytes: int, memory: str = "host") -> Any:
        return self.inner.allocate(region, nbytes, memory)

    def address_for(self, region: int) -> str:
        return self.inner.address_for(region)

    def region_memory(self, region: int) -> memoryview | None:
        return self.inner.region_memory(region)

    def unregister(self, region: int) -> None:
        self.inner.unregister(region)

    async def peer_memory(self, address: str, region: int) -> memoryview | None:
        return await self.inner.peer_memory(address, region)

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        await self.inner.write(address, header, data)

    async def next_notice(self) -> ChunkNotice:
        return await self.inner.next_notice()

    async def aclose(self) -> None:
        await self.inner.aclose()
