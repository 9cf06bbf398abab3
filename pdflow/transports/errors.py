"""What can go wrong on the KV data plane, and the notice that tells a receiver about a chunk.

Every failure a transport raises, or reports in a :class:`ChunkNotice`, is a
:class:`TransportError` subclass, so callers never see a raw ``OSError`` and never hang.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.messages import KvChunkHeader


class TransportError(Exception):
    """Base of every error a transport raises or reports in a notice."""


class TransportClosed(TransportError):
    """The transport was closed with :meth:`Transport.aclose` (before or during the call)."""


class PeerUnreachable(TransportError):
    """Cannot connect to the address (nothing listens there, timeout, handshake refused)."""


class PeerDisconnected(TransportError):
    """The connection was lost mid-transfer (the other side died or closed)."""


class IncompatiblePeer(PeerUnreachable):
    """The peer speaks another wire protocol version: run the same pdflow on both sides."""


class ChecksumMismatch(TransportError):
    """The landed bytes do not hash to ``header.checksum``."""


class UnknownRegion(TransportError):
    """A chunk for a region that is not registered (or was unregistered while it landed)."""


class OutOfBounds(TransportError):
    """``offset + nbytes`` lies beyond the region (or the offset is negative)."""


class UndecodableChunk(TransportError):
    """A chunk whose encoding this receiver cannot decode (a codec it does not know, a length or
    shape that does not fit); its span holds nothing usable."""


@dataclass(frozen=True, slots=True)
class ChunkNotice:
    """One chunk that reached this receiver.

    ``error`` is None when the bytes are in the region and their checksum is verified; otherwise
    it says why they are not (the region's bytes in the chunk's span are then unspecified).
    ``received_at`` is the ``time.monotonic()`` of the moment it landed.
    """

    header: KvChunkHeader
    error: TransportError | None = None
    received_at: float = 0.0
