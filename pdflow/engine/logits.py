"""The logits processors a request may ask for, as vLLM and OpenAI define them.

Applied to one row of logits, in vLLM's order: a guide's grammar mask, ``min_tokens`` (no
end-of-sequence or stop token yet), ``logit_bias``, then the penalties:

- ``repetition_penalty`` ``r`` (HF / vLLM): every token seen in the prompt or the output has its
  logit divided by ``r`` when positive, multiplied by ``r`` when negative;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI): a token's logit loses
  ``f * count + p * (count > 0)``, ``count`` its occurrences in the output so far.

:class:`OutputCounts` is the per-request state they need; it is updated with each token chosen.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdflow.messages import SamplingParams


class OutputCounts:
    """How often each token occurs in a request's output, and which occur in its prompt, as
    tensors the size of the vocabulary (made at the first row, whose width they take)."""

    __slots__ = ("counts", "seen", "_prompt", "_output")

    def __init__(self, prompt_ids: Iterable[int] = (), output_ids: Iterable[int] = ()):
        self.counts: torch.Tensor | None = None  # float (vocab,)
        self.seen: torch.Tensor | None = None  # bool (vocab,): in the prompt or the output
        self._prompt, self._output = list(prompt_ids), list(output_ids)

    def _made(self, vocab: int) -> None:
        if self.counts is not None:
            return
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        prompt = torch.tensor([t for t in self._prompt if 0 <= t < vocab], dtype=torch.long)
        self.seen[prompt] = True
        for token in self._output:
            self.add(token)
        self._prompt = self._output = []

    def add(self, token: int) -> None:
        if self.counts is None:
            self._output.append(token)
        elif 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1
            self.seen[token] = True

    def penalize(self, scores: torch.Tensor, params: SamplingParams) -> None:
        """Apply the request's penalties to ``scores`` (float, in place)."""
        self._made(scores.shape[-1])
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            seen = scores[self.seen]
            scores[self.seen] = torch.where(seen > 0, seen / r, seen * r)
        if params.frequency_penalty:
            scores -= params.frequency_penalty * self.counts
        if params.presence_penalty:
            scores -= params.presence_penalty * (self.counts > 0).to(scores.dtype)


def has_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def bias_tensors(bias: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logit_bias`` as (ids, values) to add with one indexed add (None: no bias)."""
    if not bias:
        return None
    ids = torch.tensor(list(bias), dtype=torch.long)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32)


def add_bias(scores: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, values = bias
    inside = ids < scores.shape[-1]
    scores.index_add_(0, ids[inside], values[inside])


def block_stops(scores: torch.Tensor, stop_ids: torch.Tensor) -> None:
    """``min_tokens``: no end-of-sequence or stop token yet, unless nothing else is allowed
    (a guide's grammar that can only end here)."""
    stop_ids = stop_ids[stop_ids < scores.shape[-1]]
    if not len(stop_ids):
        return
    kept = scores[stop_ids].clone()
    scores[stop_ids] = float("-inf")
    if not bool(torch.isfinite(scores).any()):
        scores[stop_ids] = kept


def keep_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is under ``min_p`` times the most likely one's
    (``scores`` already scaled by the temperature, maximum 0): ``exp(s) < min_p``."""
    if min_p <= 0:
        return scores
    return scores.masked_fill(scores < torch.log(torch.tensor(min_p)), float("-inf"))
