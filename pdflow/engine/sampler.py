"""Pick the next token from logits: greedy, temperature, top-k, top-p, seeded.

Safe for every value the API accepts: a temperature below :data:`GREEDY_BELOW` is greedy (dividing
by it would overflow), the scores are shifted so their maximum is 0 before they are scaled, top-p
always keeps the most likely token, and a distribution that still cannot be drawn from (logits
that are not finite) falls back to the argmax instead of raising.
"""

from __future__ import annotations

import torch

from pdflow.engine import kernels
from pdflow.messages import SamplingParams

GREEDY_BELOW = 1e-5  # as vLLM: a temperature under this picks the argmax


class Sampler:
    """One request's sampling state (its random generator lives as long as the request)."""

    __slots__ = ("params", "generator")

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if not self.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    def sample(self, logits: torch.Tensor) -> int:
        """``logits``: one row, shape ``(vocab,)``."""
        if self.greedy:
            return int(torch.argmax(logits))
        probs = self.probabilities(logits)
        if probs is None:
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The distribution :meth:`sample` draws from for one row of ``logits`` (temperature,
        top-k and top-p applied), or None where none can be drawn from (greedy sampling, or
        logits that are not finite: the argmax is then the token)."""
        if self.greedy:
            return None
        p = self.params
        scores = logits.float()
        scores = (scores - scores.max()) / p.temperature  # the top score is 0: nothing overflows
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            drop = probs.cumsum(dim=-1) - probs >= p.top_p  # keep the first over p
            drop[0] = False  # however small top_p is, the most likely token stays
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return None
        return probs


def sample_batch(logits: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """One token per row; greedy rows share one argmax."""
    greedy = kernels.argmax_rows(logits)
    return [g if s.greedy else s.sample(logits[i]) for i, (g, s) in enumerate(zip(greedy, samplers))]
