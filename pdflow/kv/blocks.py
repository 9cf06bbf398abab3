"""Block ids: what names a block of KV, the same way in every process and after every restart.

A block is the KV of ``block_tokens`` consecutive tokens. Its id is a 128-bit xxh3 of its parent
block's id and its own token ids; the first block's parent is the hash of a salt of everything
that changes the bytes (the model, the KV dtype, the block size), so the salt is in every id. One
id always means the same bytes: equal ids at block *i* of two prompts mean the prompts agree on
every token up to the end of block *i*. Only full blocks get ids; a prompt's partial last block
is private to its request.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import xxhash

__all__ = ["BlockHasher", "BlockId", "descendants", "full_blocks"]

BlockId = int  # 128 bits, from xxh3_128


def full_blocks(num_tokens: int, block_tokens: int) -> int:
    return num_tokens // block_tokens


class BlockHasher:
    """Turns token ids into chained block ids for one model, KV dtype, block size and (where the
    store encodes its blocks) codec."""

    def __init__(self, model: str, dtype: str, block_tokens: int, codec: str = "none") -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        encoded = "" if codec == "none" else f"|{codec}"  # ids of blocks kept as they are predate codecs
        self.salt = f"pdflow-kv-block/1|{model}|{dtype}|{block_tokens}{encoded}".encode()
        self._root = xxhash.xxh3_128_digest(self.salt)  # the parent of a sequence's first block

    @classmethod
    def for_pipeline(cls, pipeline) -> "BlockHasher":
        """The hasher of a :class:`~pdflow.config.pipeline.Pipeline`'s model, KV dtype and blocks."""
        model, store = pipeline.model, pipeline.kv.store_codec()
        return cls(str(model.path) if model.is_path else model.source, model.dtype, pipeline.kv.block_tokens,
                   "none" if store is None else store.spec)

    def ids(self, token_ids: list[int], start: int = 0, parent: BlockId | None = None) -> list[BlockId]:
        """The ids of the full blocks of ``token_ids``, from block ``start`` on; ``parent`` is the
        id of block ``start - 1`` (computed when not given)."""
        bt = self.block_tokens
        if start and parent is None:
            parent = self.ids(token_ids[:start * bt])[-1]
        previous = self._root if parent is None else parent.to_bytes(16, "little")
        data = array("I", token_ids[start * bt : len(token_ids) // bt * bt]).tobytes()  # 4 bytes a token
        step = 4 * bt
        out: list[BlockId] = []
        for offset in range(0, len(data), step):
            digest = xxhash.xxh3_128_intdigest(previous + data[offset : offset + step])
            out.append(digest)
            previous = digest.to_bytes(16, "little")
        return out


def reusable_blocks(hit: int, num_tokens: int, block_tokens: int) -> int:
    """Of ``hit`` cached leading blocks, how many a prompt of ``num_tokens`` can take: prefill must
    still compute its last token (that token's logits give the first output token)."""
    return min(hit, (num_tokens - 1) // block_tokens)


def answer_blocks(prompt_len: int, cached_len: int, block_tokens: int) -> range:
    """The blocks a finished sequence of ``cached_len`` tokens with KV adds after its prompt's
    full blocks (the prompt's partial last block becomes one of them once the answer fills it)."""
    return range(prompt_len // block_tokens, cached_len // block_tokens)


def descendants(roots: Iterable[BlockId], parents: Iterable[tuple[BlockId, BlockId | None]]) -> set[BlockId]:
    """``roots`` and every block built on them, given each stored block's ``(id, parent id)``
    (through a map of children made once): what goes when a block is dropped."""
    children: dict[BlockId, list[BlockId]] = {}
    for block_id, parent in parents:
        if parent is not None:
            children.setdefault(parent, []).append(block_id)
    found = set(roots)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
