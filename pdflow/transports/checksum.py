"""The checksum every KV chunk carries on the data plane and in the store (kept free of torch, so
the data plane imports fast)."""

import xxhash


def checksum(data) -> int:
    """xxh3-64 of a buffer (a read of the bytes, no copy)."""
    return xxhash.xxh3_64_intdigest(data)
