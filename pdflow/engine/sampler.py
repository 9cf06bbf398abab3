"""Pick the next token from logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from pdflow.messages import SamplingParams


class Sampler:
    """One request's sampling state (its random generator lives as long as the request)."""

    __slots__ = ("params", "generator")

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0

    def sample(self, logits: torch.Tensor) -> int:
        """``logits``: one row, shape ``(vocab,)``."""
        if self.greedy:
            return int(torch.argmax(logits))
        p = self.params
        scores = logits.float() / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= p.top_p  # keep the first over p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sample_batch(logits: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """One token per row; greedy rows share one argmax."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [g if s.greedy else s.sample(logits[i]) for i, (g, s) in enumerate(zip(greedy, samplers))]
