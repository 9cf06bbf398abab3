"""The shm transport's doorbell: its wire format, addresses, and the receiver's buffered reads.

A connection is one abstract-namespace Unix stream socket. The sender first sends ``HELLO``
(magic ``b"PDSM"``, wire version, pdflow protocol version); the receiver answers with its own.
After that each message is one ``OP`` (kind, header length, region, segment id), then that many
bytes of msgpack :class:`~pdflow.messages.KvChunkHeader`:

- sender: MAP (which memory is region r?), CHUNK (header + payload: a region in private memory),
  BEGIN (header; its payload is being copied into segment s), END (it is in place), SKIP (header;
  nothing was written: no such region, or out of bounds). END goes out at the end of the event
  loop's iteration or in front of the link's next frame, whichever comes first, so back-to-back
  writes cost the receiver one wakeup each, not two;
- receiver: MAPPED (and the memfd, as SCM_RIGHTS), PRIVATE (stream it), NONE (no such region),
  and, unasked, GONE (region r was unregistered: drop it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import socket
import struct

from pdflow.transports.errors import PeerDisconnected
from pdflow.transports.sockets import Greeting

MAGIC = b"PDSM"
WIRE_VERSION = 1
GREETING = Greeting(MAGIC, WIRE_VERSION, "shm")
OP = struct.Struct("!BxxxIqQ")  # kind, header length, region, segment id; then the header
MAP, CHUNK, BEGIN, END, SKIP = 1, 2, 3, 4, 5  # sender -> receiver
MAPPED, PRIVATE, NONE, GONE = 11, 12, 13, 14  # receiver -> sender
MAX_HEADER = 1 << 16
END_FRAME = OP.pack(END, 0, 0, 0)


def socket_name(address: str) -> str:
    """``shm://@name`` -> the abstract socket address ``"\\0name"``; ValueError for anything else."""
    name = address.removeprefix("shm://@")
    if name == address or not name:
        raise ValueError(f"not a shm address: {address!r} (expected shm://@name)")
    return "\0" + name


def name_for(host: str | None, port: int | None) -> str:
    """The socket name a receiver started with ``host`` and ``port`` takes (see :mod:`~pdflow.transports.shm`)."""
    host = host or ""
    if port:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        host = ""
    return host if host and host != "localhost" else f"pdflow-{os.getpid()}-{secrets.token_hex(4)}"


class Inbox:
    """What a receiver reads from one sender, buffered: one recv brings many doorbells; a
    streamed payload goes straight into its span (only bytes already read ahead are copied)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = memoryview(bytearray(2 * MAX_HEADER))
        self._start = self._end = 0

    async def take(self, n: int) -> memoryview | None:
        """The next ``n`` (<= MAX_HEADER) bytes, valid until the next call; None at a clean end of
        stream, PeerDisconnected at an end mid-way."""
        while self._end - self._start < n:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._start + n > self._buf.nbytes:  # move the partial message to the front
                self._buf[: self._end - self._start] = self._buf[self._start : self._end].tobytes()
                self._start, self._end = 0, self._end - self._start
            got = await asyncio.get_running_loop().sock_recv_into(self.sock, self._buf[self._end :])
            if got == 0:
                if self._start == self._end:
                    return None
                raise PeerDisconnected("the sender closed mid-message")
            self._end += got
        self._start += n
        return self._buf[self._start - n : self._start]

    async def into(self, span: memoryview) -> None:
        """Fill ``span``; PeerDisconnected if the stream ends first."""
        got = min(self._end - self._start, span.nbytes)
        span[:got] = self._buf[self._start : self._start + got]
        self._start += got
        loop = asyncio.get_running_loop()
        while got < span.nbytes:
            n = await loop.sock_recv_into(self.sock, span[got:])
            if n == 0:
                raise PeerDisconnected("the sender closed mid-payload")
            got += n
