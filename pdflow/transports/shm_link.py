"""A shm sender's connection to one receiver: the memory it mapped, the doorbell.

The sender owns the socket's outgoing side while a write sends (:attr:`ShmLink.sending`, under the
route's lock: see :mod:`~pdflow.transports.links`). What the receiver sends (answers to MAP
with their descriptors, GONE, the end of the connection) is read by a task as it comes, so a
dead receiver's memory is unmapped at once, and by each write before it looks at the mappings,
so a region the receiver has just unregistered is never written to. Wire format:
:mod:`~pdflow.transports.shm_wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from typing import Any

import structlog

from pdflow.transports.errors import PeerDisconnected
from pdflow.transports.links import Link
from pdflow.transports.shm_memory import STREAM, Mappings, map_segment
from pdflow.transports.shm_wire import END_FRAME, GONE, MAP, MAPPED, NONE, OP, PRIVATE
from pdflow.transports.sockets import send_gathered

log = structlog.get_logger()

_MAP_IN_THREAD = 16 << 20


async def _readable(sock: socket.socket) -> None:
    loop, fd = asyncio.get_running_loop(), sock.fileno()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        if sock.fileno() == fd:  # a closed socket's fd may already belong to another
            loop.remove_reader(fd)


class ShmLink(Link):
    """A sender's one connection to one receiver (``sock``, handshaken), and what it mapped of
    it. Frames go out one write at a time, which sets :attr:`sending` meanwhile; what the
    receiver sends is handled by a reader task (so GONE, or a lost connection, takes effect at
    once) and by each write before it looks at ``mappings``."""

    def __init__(self, sock: socket.socket, address: str, max_mappings: int, timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.sock: socket.socket | None = sock
        self.sending = False  # a write owns the socket's outgoing side
        self.broken = False
        self.mappings = Mappings(max_mappings)
        self.reply: asyncio.Future[tuple[int, int, int, int | None]] | None = None  # to a MAP
        self.end_pending = False  # a copy is done, its END not yet sent
        self._flush_due = False  # flush_end() is scheduled
        self._inbox = bytearray()
        self._fds: deque[int] = deque()
        self.reader: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(self._read(sock))
        log.debug("kv.shm.conn.open", peer=address)

    async def target(self, region: int) -> Any:
        """Where chunks for ``region`` go: (segment id, mapped view), STREAM (the receiver keeps
        it in private memory), or None (it has no such region; not remembered). Asks the
        receiver once (call while :attr:`sending`)."""
        target = self.mappings.get(region)
        if target is not None:
            return target
        self.reply = asyncio.get_running_loop().create_future()
        try:
            await send_gathered(self.sock, self.frame(OP.pack(MAP, 0, region, 0)))  # type: ignore[arg-type]
            async with asyncio.timeout(self.timeout_s):
                kind, answered, segment, fd = await self.reply
        except TimeoutError:
            raise PeerDisconnected(f"{self.address} did not answer within {self.timeout_s} s") from None
        finally:
            self.reply = None
        if answered != region or kind == NONE:
            if fd is not None:
                os.close(fd)
            if kind == NONE:
                return None
            raise PeerDisconnected(f"{self.address} answered for region {answered}, not {region}")
        if kind == PRIVATE:
            target = STREAM
        else:
            try:
                if os.fstat(fd).st_size < _MAP_IN_THREAD:  # type: ignore[arg-type]
                    target = (segment, map_segment(fd))  # type: ignore[arg-type]
                else:  # faulting it in takes as long as a copy: keep the loop free meanwhile
                    target = (segment, await asyncio.to_thread(map_segment, fd))
            except ValueError as exc:
                raise PeerDisconnected(f"{self.address} sent unusable memory: {exc}") from None
            log.debug("kv.shm.mapped", peer=self.address, region=region, nbytes=target[1].nbytes)
        self.mappings.put(region, target)
        return target

    def frame(self, message: bytes) -> bytes:
        """``message``, after the deferred END if there is one (call while :attr:`sending`, then send it)."""
        if not self.end_pending:
            return message
        self.end_pending = False
        return END_FRAME + message

    def ended(self) -> None:
        """The copy is done (call while :attr:`sending`): its END goes with the next frame or soon after."""
        self.end_pending = True
        if not self._flush_due:  # once per burst of writes, not once per write
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush_end)

    def flush_end(self) -> None:
        """Send a deferred END now, unless a write holds the socket (it sends it first)."""
        self._flush_due = False
        if not self.end_pending or self.sending or self.sock is None or self.broken:
            return
        try:
            sent = self.sock.send(END_FRAME)  # this small a send goes whole or not at all
        except BlockingIOError:  # the receiver lags: try again soon
            self._flush_due = True
            asyncio.get_running_loop().call_later(0.001, self.flush_end)
            return
        except OSError as exc:
            sent, error = 0, str(exc)
        else:
            error = "a doorbell went out in part"
        self.end_pending = False
        if sent < len(END_FRAME):
            self.lost(PeerDisconnected(f"lost connection to {self.address}: {error}"))

    def usable(self) -> bool:
        """Connected, with everything the receiver sent so far handled."""
        if self.sock is None or self.broken:
            return False
        try:
            self._drain()
        except PeerDisconnected as exc:
            self.lost(exc)
            return False
        return True

    def _drain(self) -> None:
        """Handle what the receiver sent; PeerDisconnected if it closed or broke the protocol."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 4096, 4)  # type: ignore[arg-type]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise PeerDisconnected(f"lost connection to {self.address}: {exc}") from exc
            self._fds.extend(fds)
            if not data:
                raise PeerDisconnected(f"{self.address} closed the connection")
            self._inbox += data
            while len(self._inbox) >= OP.size:
                kind, _, region, segment = OP.unpack_from(self._inbox)
                del self._inbox[: OP.size]
                if kind == GONE:
                    self.mappings.drop(region)
                    continue
                if kind not in (MAPPED, PRIVATE, NONE) or (kind == MAPPED and not self._fds):
                    raise PeerDisconnected(f"{self.address} broke the protocol (message {kind})")
                fd = self._fds.popleft() if kind == MAPPED else None
                if self.reply is not None and not self.reply.done():
                    self.reply.set_result((kind, region, segment, fd))
                elif fd is not None:
                    os.close(fd)

    async def _read(self, sock: socket.socket) -> None:
        try:
            while self.sock is sock and not self.broken:
                await _readable(sock)
                if self.sock is sock:
                    self._drain()
        except PeerDisconnected as exc:
            if self.sock is sock:
                self.lost(exc)

    def lost(self, error: PeerDisconnected) -> None:
        """The connection broke: drop every mapping now (so the receiver's memory can go), fail a
        pending MAP, wake a blocked write; close unless a write holds the socket (it closes it)."""
        if self.sock is None or self.broken:
            return
        log.warning("kv.shm.conn.lost", peer=self.address, error=str(error))
        self.broken = True
        self.mappings.clear()
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(error)
        if self.sending:
            self.interrupt()
        else:
            self.close()

    def interrupt(self) -> None:
        """Wake whatever waits on the socket (it fails with EPIPE); the write then closes it."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Send a deferred END if it can go now, close the socket, forget the mappings (idempotent)."""
        if self.sock is not None:
            if self.end_pending and not self.broken:  # no frame began after it: a message boundary
                with contextlib.suppress(OSError):
                    self.sock.send(END_FRAME)
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        self.end_pending = False
        if self.reader is not None and self.reader is not asyncio.current_task():
            self.reader.cancel()
        self.reader = None
        self.mappings.clear()
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(PeerDisconnected(f"connection to {self.address} closed"))
        while self._fds:
            os.close(self._fds.popleft())
        self._inbox.clear()
