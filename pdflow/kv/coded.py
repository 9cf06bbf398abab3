"""KV codecs on the data plane: a transport whose writes encode KV chunks with a link's codec,
and whose notices hand out chunks decoded where they landed.

:class:`CodedTransport` wraps any transport (emulated links included, so the wire's bandwidth
is spent on encoded bytes). On the sending side, with a codec, a chunk of keys or values
(``header.kind`` 0 or 1, not yet encoded) is encoded block by block (:mod:`pdflow.kv.codecs`) and
written in its place: the payload is the encoding, the header says which codec and block size,
and its ``nbytes`` and ``checksum`` are the encoding's, so the receiver's checksum covers the
bytes that travelled. The encoded payload lands at the start of the span the decoded KV takes in
the receiver's region.

On the receiving side (every stage that receives KV wraps its endpoint, codec or not), a notice
for an encoded chunk is handed out only once the chunk is decoded into that span, with a header
that describes the decoded bytes (codec "none"), so the rest of the stage never sees an
encoding (its checksum stays the encoded payload's, which was verified on arrival: decoded KV
differs from what the sender had, so no checksum of the sender's bytes could hold). A chunk that
cannot be decoded (a codec this process does not know, a length or shape
that does not fit, a span beyond the region) comes out as a notice carrying
:class:`~pdflow.transports.errors.UndecodableChunk`; nothing a peer sends raises here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pdflow.transports.checksum import checksum
from pdflow.kv.codecs import KvCodec, from_spec
from pdflow.kv.layout import KEYS, VALUES, torch_dtype
from pdflow.messages import KvChunkHeader
from pdflow.transports.base import Transport
from pdflow.transports.delegating import DelegatingTransport
from pdflow.transports.errors import ChunkNotice, UndecodableChunk
from pdflow.transports.regions import byte_view

__all__ = ["COUNTERS", "CodedTransport", "decode_in_place", "encode_chunk"]

COUNTERS = ("kv_chunks_encoded", "kv_bytes_before_encoding", "kv_bytes_encoded", "kv_chunks_decoded",
            "kv_bytes_received_encoded", "kv_bytes_decoded", "kv_chunks_undecodable")


def encode_chunk(codec: KvCodec, block_tokens: int, header: KvChunkHeader, data: Any) -> tuple[KvChunkHeader, Any]:
    """``header`` and ``data`` as they travel with ``codec``: unchanged unless the chunk is raw
    keys or values and the codec is lossy."""
    import torch

    if codec.lossless or header.kind not in (KEYS, VALUES) or header.codec != "none":
        return header, data
    raw = torch.frombuffer(byte_view(data), dtype=torch.uint8) if header.nbytes else torch.empty(0, dtype=torch.uint8)
    chunk = raw.view(torch_dtype(header.dtype)).view(*header.shape)
    encoded = codec.encode_run(chunk, header.kind, block_tokens, header.layer)
    return msgspec.structs.replace(header, nbytes=encoded.numel(), checksum=checksum(byte_view(encoded)),
                                   codec=codec.spec, codec_block=block_tokens), encoded


def decode_in_place(header: KvChunkHeader, region: memoryview | None) -> KvChunkHeader:
    """Decode a landed encoded chunk into its span of ``region``; the header of the decoded bytes.
    Raises UndecodableChunk naming what is wrong."""
    import torch

    try:
        codec = from_spec(header.codec)
        dtype = torch_dtype(header.dtype)
    except ValueError as exc:
        raise UndecodableChunk(str(exc)) from None
    tokens = header.token_end - header.token_start
    if header.kind not in (KEYS, VALUES) or len(header.shape) != 3 or header.shape[0] != tokens or tokens <= 0 \
            or min(header.shape) <= 0 or header.codec_block <= 0:
        raise UndecodableChunk(f"an encoded chunk must be keys or values of its tokens in blocks: kind {header.kind}, "
                               f"shape {header.shape}, tokens {tokens}, codec_block {header.codec_block}")
    raw_bytes = tokens * header.shape[1] * header.shape[2] * dtype.itemsize
    if region is None or header.offset < 0 or header.offset + raw_bytes > region.nbytes:
        raise UndecodableChunk(f"decoded, the chunk [{header.offset}, {header.offset + raw_bytes}) would lie beyond "
                               f"region {header.region}")
    if header.offset % dtype.itemsize:
        raise UndecodableChunk(f"offset {header.offset} is not aligned to {header.dtype} ({dtype.itemsize} bytes)")
    span = torch.frombuffer(region, dtype=torch.uint8, count=raw_bytes, offset=header.offset)
    try:
        codec.decode_run(span[: header.nbytes], header.kind, span.view(dtype).view(*header.shape), header.codec_block,
                         header.layer)
    except (ValueError, RuntimeError) as exc:  # a length, a shape or a layout that does not fit
        raise UndecodableChunk(f"chunk of {header.request_id!r} layer {header.layer}: {exc}") from None
    return msgspec.structs.replace(header, nbytes=raw_bytes, codec="none", codec_block=0)


class CodedTransport(DelegatingTransport):
    """``inner`` with KV encoded on its writes (``codec``: None or lossless writes as they are)
    and decoded in its notices. Every other attribute and method is the inner transport's."""

    def __init__(self, inner: Transport, codec: KvCodec | None = None, block_tokens: int = 0) -> None:
        if codec is not None and not codec.lossless and block_tokens <= 0:
            raise ValueError(f"a codec needs the block size, got block_tokens={block_tokens}")
        super().__init__(inner)
        self.codec, self.block_tokens = codec, block_tokens
        self._kept: dict[int, tuple[str, int]] = {}  # region -> (codec spec, block) it holds encoded
        # what went through: KV chunks encoded on writes (their raw and encoded bytes), decoded
        # from notices (their encoded and decoded bytes), refused as undecodable
        self.counts = dict.fromkeys(COUNTERS, 0)

    def __repr__(self) -> str:
        return f"CodedTransport({self.inner!r}, codec={self.codec!r})"

    def keep(self, region: int, codec: KvCodec, block_tokens: int) -> None:
        """Region ``region`` holds KV encoded with ``codec`` in blocks of ``block_tokens`` (the
        store's memory tier): chunks so encoded stay as they landed; any other chunk for it is
        refused (UndecodableChunk), as it does not fit the region's layout."""
        self._kept[region] = (codec.spec, block_tokens)

    async def write(self, address: str, header: KvChunkHeader, data: Any) -> None:
        if self.codec is not None:
            raw = header.nbytes
            header, data = encode_chunk(self.codec, self.block_tokens, header, data)
            if header.codec != "none":
                self.counts["kv_chunks_encoded"] += 1
                self.counts["kv_bytes_before_encoding"] += raw
                self.counts["kv_bytes_encoded"] += header.nbytes
        await self.inner.write(address, header, data)

    async def next_notice(self) -> ChunkNotice:
        notice = await self.inner.next_notice()
        header = notice.header
        kept = self._kept.get(header.region)
        if kept is not None and notice.error is None:
            if (header.codec, header.codec_block) == kept:
                return notice
            self.counts["kv_chunks_undecodable"] += 1
            why = f"region {header.region} holds KV in {kept[0]} (blocks of {kept[1]}); a chunk in {header.codec} " \
                  f"(blocks of {header.codec_block}) does not fit it"
            return ChunkNotice(header, UndecodableChunk(why), notice.received_at)
        if notice.error is not None or header.codec == "none":
            return notice
        try:
            decoded = decode_in_place(header, self.inner.region_memory(header.region))
        except UndecodableChunk as exc:
            self.counts["kv_chunks_undecodable"] += 1
            return ChunkNotice(header, exc, notice.received_at or time.monotonic())
        self.counts["kv_chunks_decoded"] += 1
        self.counts["kv_bytes_received_encoded"] += header.nbytes
        self.counts["kv_bytes_decoded"] += decoded.nbytes
        return ChunkNotice(decoded, None, notice.received_at)
