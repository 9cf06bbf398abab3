"""KV codecs on the data plane (pdflow.kv.coded), over real tcp transports in this process: a
sender with a codec writes encoded chunks, the receiver hands them out decoded where they belong;
what cannot be decoded comes out as a notice carrying UndecodableChunk, never an exception."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from pdflow import transports
from pdflow.transports.checksum import checksum
from pdflow.kv.chunks import header as chunk_header
from pdflow.kv.codecs import codec
from pdflow.kv.coded import CodedTransport
from pdflow.kv.layout import KEYS, VALUES, KvLayout
from pdflow.transports import UndecodableChunk
from pdflow.transports.regions import byte_view

LAYOUT = KvLayout(num_layers=2, num_kv_heads=3, head_dim=64)
TOKENS, BLOCK = 150, 64


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, 3, 64, generator=torch.Generator().manual_seed(seed)) * 2


async def _pair(name: str | None, **options):
    receiver = CodedTransport(transports.create("tcp"))
    await receiver.start()
    memory = receiver.allocate(1, LAYOUT.request_bytes(TOKENS))
    sender = CodedTransport(transports.create("tcp", **options), None if name is None else codec(name), BLOCK)
    return sender, receiver, memory


@pytest.mark.parametrize("name", ["int8", "int4", None])
def test_encoded_chunks_land_decoded_where_they_belong(name):
    async def scenario():
        sender, receiver, memory = await _pair(name)
        buffer = torch.frombuffer(memory, dtype=torch.uint8)
        sent = {}
        try:
            for layer in range(LAYOUT.num_layers):
                for kind in (KEYS, VALUES):
                    x = _kv(10 * layer + kind)
                    data = byte_view(x)
                    h = chunk_header("r", layer, kind, 0, TOKENS, LAYOUT, 1, LAYOUT.offset(TOKENS, layer, kind), data)
                    await sender.write(receiver.address, h, data)
                    sent[(layer, kind)] = (x, h)
            for _ in sent:
                notice = await asyncio.wait_for(receiver.next_notice(), 10)
                assert notice.error is None
                x, h = sent[(notice.header.layer, notice.header.kind)]
                # the decoded bytes, as the sender described them (the checksum: the encoding's)
                assert msgspec.structs.replace(notice.header, checksum=h.checksum) == h
            keys, values = LAYOUT.views(buffer, TOKENS, 1)
            for kind, got in ((KEYS, keys), (VALUES, values)):
                x = sent[(1, kind)][0]
                if name is None:
                    assert torch.equal(got.transpose(0, 1), x)
                else:
                    c = codec(name)
                    want = torch.empty_like(x)
                    c.decode_run(c.encode_run(x, kind, BLOCK), kind, want, BLOCK)
                    assert torch.equal(got.transpose(0, 1), want)
            counts = sender.counts
            if name is None:
                assert counts["kv_chunks_encoded"] == 0 and receiver.counts["kv_chunks_decoded"] == 0
            else:
                assert counts["kv_chunks_encoded"] == 4 and receiver.counts["kv_chunks_decoded"] == 4
                assert counts["kv_bytes_before_encoding"] == LAYOUT.request_bytes(TOKENS)
                assert counts["kv_bytes_encoded"] == receiver.counts["kv_bytes_received_encoded"]
                assert counts["kv_bytes_encoded"] * (3.5 if name == "int8" else 6) < counts["kv_bytes_before_encoding"]
        finally:
            await sender.aclose()
            await receiver.aclose()

    asyncio.run(scenario())


def test_what_cannot_be_decoded_is_a_notice_not_a_crash():
    """A codec the receiver does not know, a length that does not fit, a span beyond the region:
    each chunk's notice carries UndecodableChunk naming why, and the next good chunk still lands."""
    async def scenario():
        sender, receiver, memory = await _pair(None)
        plain = transports.create("tcp")
        try:
            x = _kv(1)
            good = codec("int8").encode_run(x, KEYS, BLOCK)
            data = byte_view(good)
            base = chunk_header("r", 0, KEYS, 0, TOKENS, LAYOUT, 1, 0, byte_view(x))
            base = msgspec.structs.replace(base, nbytes=data.nbytes, checksum=checksum(data), codec="int8",
                                           codec_block=BLOCK)
            bad = [
                (msgspec.structs.replace(base, codec="zstd"), "cannot decode"),
                (msgspec.structs.replace(base, codec="int8:key_group=16"), "bytes"),  # another layout
                (msgspec.structs.replace(base, codec_block=0), "codec_block"),
                (msgspec.structs.replace(base, offset=len(memory) - data.nbytes), "beyond region"),
                (msgspec.structs.replace(base, shape=(TOKENS, 3)), "shape"),
                (msgspec.structs.replace(base, offset=2), "aligned"),
                (msgspec.structs.replace(base, shape=(TOKENS, 3, 63)), "int8"),  # another shape: another length
            ]
            for h, _ in bad:
                await plain.write(receiver.address, h, data)
            await plain.write(receiver.address, base, data)
            for _, why in bad:
                notice = await asyncio.wait_for(receiver.next_notice(), 10)
                assert isinstance(notice.error, UndecodableChunk) and why in str(notice.error), notice.error
            notice = await asyncio.wait_for(receiver.next_notice(), 10)
            assert notice.error is None and notice.header.codec == "none" and notice.header.nbytes == x.nbytes
            assert receiver.counts["kv_chunks_undecodable"] == len(bad)
        finally:
            for t in (plain, sender, receiver):
                await t.aclose()

    asyncio.run(scenario())


def test_an_emulated_link_carries_the_encoded_bytes():
    """The codec encodes before the link's bandwidth is spent: 4 MB of KV through a 100 Mbit link
    takes about a quarter of the time with int8."""
    import time

    async def timed(name):
        sender, receiver, memory = await _pair(name, bandwidth="100Mbit")
        x = torch.randn(4096, 3, 64)
        data = byte_view(x)
        layout = KvLayout(1, 3, 64)
        receiver.unregister(1)
        receiver.allocate(1, layout.request_bytes(4096))
        try:
            h = chunk_header("r", 0, KEYS, 0, 4096, layout, 1, 0, data)
            started = time.monotonic()
            await sender.write(receiver.address, h, data)
            await sender.write(receiver.address, msgspec.structs.replace(h, kind=VALUES, offset=x.nbytes), data)
            for _ in range(2):
                assert (await asyncio.wait_for(receiver.next_notice(), 20)).error is None
            return time.monotonic() - started
        finally:
            await sender.aclose()
            await receiver.aclose()

    plain, encoded = asyncio.run(timed(None)), asyncio.run(timed("int8"))
    assert encoded < plain / 2.5, (plain, encoded)


def test_a_region_that_keeps_an_encoding_takes_chunks_in_it_as_they_are():
    """The store's arena in int8: chunks encoded so land and stay encoded (the notice says so);
    a chunk in another encoding, or none, is refused."""
    async def scenario():
        sender, receiver, memory = await _pair(None)
        receiver.keep(1, codec("int8"), BLOCK)
        try:
            x = _kv(2)
            encoded = codec("int8").encode_run(x, KEYS, BLOCK)
            data = byte_view(encoded)
            h = msgspec.structs.replace(chunk_header("r", 0, KEYS, 0, TOKENS, LAYOUT, 1, 0, byte_view(x)),
                                        nbytes=data.nbytes, checksum=checksum(data), codec="int8", codec_block=BLOCK)
            await sender.write(receiver.address, h, data)
            kept = await asyncio.wait_for(receiver.next_notice(), 10)
            assert kept.error is None and kept.header == h
            assert bytes(memory[: data.nbytes]) == bytes(data)
            raw = byte_view(x)
            await sender.write(receiver.address, chunk_header("r", 0, VALUES, 0, TOKENS, LAYOUT, 1, 0, raw), raw)
            refused = await asyncio.wait_for(receiver.next_notice(), 10)
            assert isinstance(refused.error, UndecodableChunk) and "holds KV in int8" in str(refused.error)
        finally:
            await sender.aclose()
            await receiver.aclose()

    asyncio.run(scenario())
