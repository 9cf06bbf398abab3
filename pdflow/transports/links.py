"""A sender's connections: one :class:`Link` per peer, used by one write at a time, in call order.

:meth:`Transport.write <pdflow.transports.base.Transport.write>` is the one write path of the
transports that connect to their peers. It keeps a :class:`Route` per peer: the lock that
orders the writes to it, the live link, and how the last connect went. A transport supplies the
link (its ``_connect``) and the send step (its ``_send``); this module knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from pdflow.transports.errors import PeerUnreachable


class Link(ABC):
    """One connection from a sender to one peer, made by a transport's ``_connect``.

    ``write()`` sends on it under its route's lock, one chunk at a time, and closes it when a
    send fails or is cancelled; a closed or broken link is replaced by the next write.
    """

    @abstractmethod
    def usable(self) -> bool:
        """False once it is closed or the peer went (checked now, without waiting)."""

    @abstractmethod
    def close(self) -> None:
        """Close it now and wake whatever waits on it. Idempotent; never raises."""

    def interrupt(self) -> None:
        """The transport is closing while a write holds this link: make that write fail soon
        (e.g. shut the socket down). The write then closes the link. Default: close it."""
        self.close()


class Route:
    """How a sender reaches one peer: ``lock`` (FIFO, so writes go out in call order), the live
    ``link`` if there is one, and how many connects were tried (``attempts``) and why the last
    one failed (``failure``), so that writes queued behind a failed connect fail at once."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.lock = asyncio.Lock()
        self.link: Link | None = None
        self.attempts = 0
        self.failure: PeerUnreachable | None = None
        self.sent_bytes = 0  # payload bytes written to this peer

    async def reconnect(self, attempts: int, connect: Callable[[str], Awaitable[Link]]) -> Link:
        """A new link in place of the one there is (closed, broken) or none (call under ``lock``).

        ``attempts`` is what :attr:`attempts` was when the caller started to wait for the lock:
        if a connect failed meanwhile, this raises that failure again instead of trying anew.
        """
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.failure is not None and self.attempts > attempts:
            # it failed while we queued: fail too rather than wait out a timeout each
            raise type(self.failure)(*self.failure.args)
        self.attempts += 1
        self.failure = None
        try:
            self.link = await connect(self.peer)
        except PeerUnreachable as exc:
            self.failure = exc
            raise
        return self.link

    def close(self, busy: bool = False) -> None:
        """For the transport's aclose(): close the link, or only interrupt it if a write holds it
        (that write then closes it), unless ``busy``: close it anyway."""
        if self.link is None:
            return
        if self.lock.locked() and not busy:
            self.link.interrupt()
        else:
            self.link.close()
