"""The data plane under hostile peers (tcp, the default; in this process): a peer that does not
prove the pipeline's key, stalls in the handshake, or, once admitted, sends truncated frames,
lying headers, flipped bits or stops mid-frame, costs only its own connection. The receiver stays
up, writes nothing outside the spans its headers name inside registered regions, reports every
bad chunk in a notice, and a well-behaved sender's chunk still lands intact afterwards.

Bounded for CI (``PDFLOW_FUZZ_EXAMPLES``, default 20 per test).
"""

from __future__ import annotations

import asyncio
import os
import socket

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdflow import transports
from pdflow.kv.layout import checksum
from pdflow.messages import KvChunkHeader
from pdflow.transports.sockets import split_address
from pdflow.transports.tcp import FRAME, GREETING, MAGIC, WIRE_VERSION

FUZZ_EXAMPLES = int(os.environ.get("PDFLOW_FUZZ_EXAMPLES", "20"))
KEY = os.urandom(32)
GUARD = 256
REGION = 4096


def _header(region: int, offset: int, payload: bytes, **changes) -> KvChunkHeader:
    fields = dict(request_id="r", layer=0, kind=-1, token_start=0, token_end=0, dtype="uint8",
                  shape=(len(payload),), region=region, offset=offset, nbytes=len(payload),
                  checksum=checksum(memoryview(payload)))
    return KvChunkHeader(**{**fields, **changes})


def _frame(header: KvChunkHeader, payload: bytes) -> bytes:
    encoded = msgspec.msgpack.encode(header)
    return FRAME.pack(MAGIC, WIRE_VERSION, len(encoded)) + encoded + payload


class _Receiver:
    """A started tcp receiver with one guarded region; the guards must never change."""

    async def __aenter__(self):
        self.transport = transports.create("tcp", timeout_s=1.0)
        self.transport.authenticate(KEY)
        await self.transport.start()
        self.buffer = bytearray(GUARD + REGION + GUARD)
        self.transport.register(1, memoryview(self.buffer)[GUARD:GUARD + REGION])
        return self

    async def __aexit__(self, *exc):
        await self.transport.aclose()

    def guards_intact(self) -> bool:
        return self.buffer[:GUARD] == bytes(GUARD) and self.buffer[GUARD + REGION:] == bytes(GUARD)

    async def raw(self, prove: bool = True) -> socket.socket:
        """A raw connection to it, through the handshake (with the key) when ``prove``."""
        host, port = split_address(self.transport.address, "tcp")
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        if prove:
            assert await GREETING.greet(sock, KEY) is None
        return sock

    async def a_good_chunk_lands(self) -> None:
        data = os.urandom(REGION)
        async with transports.create("tcp") as sender:
            sender.authenticate(KEY)
            chunk = _header(1, 0, data)
            await asyncio.wait_for(sender.write(self.transport.address, chunk, data), 10)
            while True:  # skip the notices of whatever the fuzz sent
                notice = await asyncio.wait_for(self.transport.next_notice(), 10)
                if notice.header == chunk:
                    break
        assert notice.error is None and self.buffer[GUARD:GUARD + REGION] == data and self.guards_intact()


def _drain(receiver: _Receiver) -> list:
    notices = []
    while not receiver.transport._notices.empty():
        notices.append(receiver.transport._notices.get_nowait())
    return notices


@st.composite
def _streams(draw) -> bytes:
    """What an admitted but hostile sender writes: frames whose parts lie, and junk."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["junk", "lying", "flipped", "truncated", "bad-prefix"]))
        payload = draw(st.binary(min_size=0, max_size=512))
        offset = draw(st.integers(-(2**40), 2**40) | st.integers(0, REGION))
        if kind == "junk":
            parts.append(draw(st.binary(max_size=256)))
        elif kind == "lying":  # the header says other than what follows
            header = _header(draw(st.sampled_from([1, 2, 999])), offset, payload,
                             nbytes=draw(st.sampled_from([len(payload), max(len(payload) - 1, 0), -5])),
                             checksum=draw(st.integers(0, 2**64 - 1)))
            parts.append(_frame(header, payload))
        elif kind == "flipped":  # a good frame with bits flipped anywhere (header or payload)
            frame = bytearray(_frame(_header(1, draw(st.integers(0, REGION - len(payload))), payload), payload))
            for _ in range(draw(st.integers(1, 6))):
                i = draw(st.integers(0, len(frame) - 1))
                frame[i] ^= 1 << draw(st.integers(0, 7))
            parts.append(bytes(frame))
        elif kind == "truncated":  # the peer stops mid-frame
            frame = _frame(_header(1, 0, payload), payload)
            parts.append(frame[:draw(st.integers(0, len(frame) - 1))])
            break
        else:
            parts.append(FRAME.pack(b"XXXX", 9, draw(st.integers(0, 2**32 - 1))))
    return b"".join(parts)


async def test_hostile_frames_cost_only_their_connection() -> None:
    async with _Receiver() as receiver:
        loop = asyncio.get_running_loop()
        sent = []

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(stream=_streams())
        def fuzz(stream):
            sent.append(stream)

        fuzz()  # draw the streams first: hypothesis runs its examples synchronously
        for stream in sent:
            sock = await receiver.raw()
            await loop.sock_sendall(sock, stream)
            sock.close()
            await asyncio.sleep(0.01)
            for notice in _drain(receiver):
                if notice.error is None:  # only a chunk whose checksum matched may count as landed
                    assert notice.header.region == 1 and 0 <= notice.header.offset <= REGION - notice.header.nbytes
            assert receiver.guards_intact()
        await asyncio.sleep(0.2)
        _drain(receiver)
        await receiver.a_good_chunk_lands()


async def test_peers_that_do_not_prove_the_key_or_stall_are_cut_off() -> None:
    async with _Receiver() as receiver:
        loop = asyncio.get_running_loop()
        host, port = split_address(receiver.transport.address, "tcp")
        for stream in [b"", os.urandom(64), GREETING.ours + bytes(17) + os.urandom(32),  # no proof / a wrong one
                       _frame(_header(1, 0, b"x" * 16), b"x" * 16)]:  # a frame with no handshake at all
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, stream)
            closed = await asyncio.wait_for(_closed(loop, sock), 5)  # receiver timeout_s = 1
            sock.close()
            assert closed
        assert receiver.buffer == bytearray(GUARD + REGION + GUARD) and not _drain(receiver)
        await receiver.a_good_chunk_lands()


async def _closed(loop, sock: socket.socket) -> bool:
    """Read until the peer closes; True when it did (whatever it said first)."""
    while True:
        try:
            data = await loop.sock_recv(sock, 4096)
        except ConnectionResetError:
            return True
        if not data:
            return True
