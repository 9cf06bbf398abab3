"""Which half of a layer's KV a chunk or block holds (``KvChunkHeader.kind``): keys or values."""

KEYS, VALUES = 0, 1
