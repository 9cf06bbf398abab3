"""Prompts of an exact token length, made of real words, that share prefixes when asked to.

A prompt is a list of *blocks*; a block's tokens depend only on its key (a trace's hash id, or a
request's own key) and the seed, so two requests whose leading keys agree get prompts whose
leading token ids agree, and a server's prefix cache sees the reuse the trace describes.
A block is made by sampling words from :data:`WORDS` with an RNG seeded by its key and joining
their ids (each word tokenized once by the model's tokenizer, with its leading space), cut to the
block's length. Tokenizers split text at spaces before merging, so the joined ids are what the
block's text tokenizes to, and joined blocks decode to text that tokenizes back to (nearly) the
same count; :meth:`PromptBuilder.retokenize_error` measures how nearly.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = """
the of and to in is was for on that with as by at from his her they this have had not are but
were which one all their there been when who will more would out about some time them into only
its can other than then also these after first two made like any our over such even most where
very through back years much before great same right just long little world people house water
place state city school night light story morning garden river mountain window letter music
table market winter summer autumn spring forest island village harbor bridge station kitchen
doctor teacher student farmer sailor painter writer soldier friend mother father brother sister
child family evening question answer reason number paper study field power country language
history science nature animal bird horse stone green blue yellow bright quiet small large old
young early late warm cold open close begin carry follow remember travel listen speak write read
build grow change move stand walk learn bring hold turn show play live believe happen provide
sit lose pay meet include continue set keep leave seem help talk start call try ask need feel
become give find tell work think know take see come want look use make good new high different
important public several able human local social national political free real best better sure
clear whole common strong special certain personal hard full simple easy short heavy dark deep
road train ship plane engine wheel machine tool hammer rope basket bottle glass plate spoon
bread cheese apple orange lemon butter honey salt sugar coffee dinner breakfast lunch supper
church castle tower wall gate door floor roof chair bed lamp clock mirror picture book pencil
valley desert ocean shore beach cloud rain snow wind storm thunder sun moon star sky earth fire
""".split()


class Tokenizer:
    """The model's tokenizer for counting and cutting: the fast ``tokenizers`` file when there is
    one (imports in a fraction of a second), else ``transformers.AutoTokenizer``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as Fast

            fast = Fast.from_file(str(path / "tokenizer.json"))
            self._encode = lambda text: fast.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: fast.decode(ids, skip_special_tokens=False)
        else:
            from transformers import AutoTokenizer

            slow = AutoTokenizer.from_pretrained(path)
            self._encode = lambda text: slow.encode(text, add_special_tokens=False)
            self._decode = lambda ids: slow.decode(ids)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))


class PromptBuilder:
    """Deterministic blocks of real words, ``seed`` and the block's key fixing every token."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self._word_ids = [tokenizer.encode(" " + word) for word in WORDS]
        self._blocks: dict[str, list[int]] = {}

    def block(self, key: str, length: int) -> list[int]:
        """``length`` token ids for ``key``; a shorter request for the same key gets a prefix
        (every draw takes one number from the key's RNG, so a longer block extends a shorter)."""
        ids = self._blocks.get(key, [])
        if len(ids) < length:
            rng, ids = random.Random(f"{self.seed}:{key}"), []
            while len(ids) < length:
                for word in rng.choices(range(len(WORDS)), k=length - len(ids)):
                    ids += self._word_ids[word]
            self._blocks[key] = ids
        return ids[:length]

    def prompt(self, keys: list[str], lengths: list[int]) -> list[int]:
        """The ids of the blocks ``keys`` of ``lengths`` tokens each, joined in order."""
        ids: list[int] = []
        for key, length in zip(keys, lengths, strict=True):
            ids += self.block(key, length)
        return ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def retokenize_error(self, ids: list[int]) -> int:
        """How many tokens the prompt's text gains (+) or loses (−) when tokenized again: the
        drift a text prompt (chat) sees because tokens merged across block boundaries."""
        return len(self.tokenizer.encode(self.text(ids))) - len(ids)
