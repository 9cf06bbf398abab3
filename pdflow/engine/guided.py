"""Guided decoding: the output follows a grammar (a JSON schema, any JSON object), enforced by
masking the logits of every token the grammar does not allow next.

The grammar engine is llguidance (the Rust library behind vLLM's ``guidance`` backend), not
pdflow's own: a request's guide travels as text in ``SamplingParams.guide``
(:mod:`pdflow.guides`), ingress checks that it compiles, and the stages
that sample (prefill for the first token, decode for the rest) each run a matcher over it
(:class:`GuideCompiler`), decode's first fed the token prefill chose.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from pdflow.guides import grammar


class Guide:
    """One request's grammar state: which tokens may come next, advanced by each one chosen."""

    __slots__ = ("matcher", "bitmask")

    def __init__(self, matcher, vocab: int):
        import llguidance.numpy  # (not llguidance.torch: importing it runs torch.compile, 3 s of CPU)

        self.matcher = matcher
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def mask(self, scores: torch.Tensor) -> None:
        """Set the scores of the tokens the grammar forbids next to -inf (in place). (Unpacked
        here: llguidance's own ``apply_token_bitmask_inplace`` compiles a kernel with
        torch.compile, and importing its module costs 3 s of CPU.) The bitmask's 32-bit words hold
        token ``32 * word + bit`` at ``bit``: their bytes in little-endian order, unpacked
        least significant bit first, are the tokens in order (numpy's ``unpackbits``: about
        20 µs for a 49k vocabulary, a seventh of shifting in torch)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        words = np.invert(self.bitmask[0]).view(np.uint32).astype("<u4", copy=False)
        forbidden = np.unpackbits(words.view(np.uint8), bitorder="little")[: scores.shape[-1]]
        scores.masked_fill_(torch.from_numpy(forbidden.view(np.bool_)), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)


class GuideCompiler:
    """Makes :class:`Guide` objects for one model: its tokenizer as llguidance sees it is
    built once, at the first guided request (from tokenizer.json: under half a second)."""

    def __init__(self, model_dir: str | Path, vocab: int, eos_token_ids: frozenset[int]):
        self.model_dir, self.vocab, self.eos = Path(model_dir), vocab, sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self):
        """The model's tokenizer as llguidance sees it (built at the first call)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._from_files()
            return self._tokenizer

    def _from_files(self):
        import llguidance

        eos = self.eos[0] if self.eos else None
        fast = self.model_dir / "tokenizer.json"
        if fast.is_file():  # parsed in Rust (a fraction of a second)
            return llguidance.LLTokenizer(fast.read_text(encoding="utf-8"), n_vocab=self.vocab, eos_token=eos)
        import llguidance.hf
        from transformers import AutoTokenizer

        from pdflow.log import quiet_transformers

        quiet_transformers()
        hf = AutoTokenizer.from_pretrained(self.model_dir)
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab, eos_token=eos)

    def guide(self, text: str, accepted: list[int] | tuple[int, ...] = ()) -> Guide:
        """A fresh matcher for ``text``, advanced past the tokens ``accepted`` so far."""
        import llguidance

        matcher = llguidance.LLMatcher(self.load(), grammar(text))
        if matcher.is_error():
            raise ValueError(f"guide does not compile: {matcher.get_error()}")
        guide = Guide(matcher, self.vocab)
        for token in accepted:
            guide.accept(token)
        return guide
