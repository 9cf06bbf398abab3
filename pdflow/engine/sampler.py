"""Pick the next token from logits: greedy, temperature, top-k, top-p, min-p, seeded; with the
request's logits processors (:mod:`pdflow.engine.logits`: penalties, bias, ``min_tokens``), a
guide's grammar (:mod:`pdflow.engine.guided`) and the chosen tokens' logprobs where it asks.

Safe for every value the API accepts: a temperature below :data:`GREEDY_BELOW` is greedy (dividing
by it would overflow), the scores are shifted so their maximum is 0 before they are scaled, top-p
always keeps the most likely token, and a distribution that still cannot be drawn from (logits
that are not finite) falls back to the argmax instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdflow import kernels
from pdflow.engine import logits as processors
from pdflow.engine.guided import Guide, GuideCompiler
from pdflow.engine.logprobs import token_logprob
from pdflow.messages import SamplingParams, TokenLogprob

GREEDY_BELOW = 1e-5  # as vLLM: a temperature under this picks the argmax


class Sampler:
    """One request's sampling state (its random generator, its output's token counts, its
    guide's grammar state: they live as long as the request).

    ``eos_token_ids``: the model's, which ``min_tokens`` holds back; ``prompt_ids``: the
    prompt (a repetition penalty counts its tokens); ``generated``: output tokens chosen before
    this sampler's first (decode's: the one prefill chose); ``guide``: the grammar, already
    advanced past ``generated``.
    """

    __slots__ = ("params", "generator", "counts", "guide", "bias", "stop_ids", "generated", "logprobs")

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = (), prompt_ids: Iterable[int] = (),
                 generated: Iterable[int] = (), guide: Guide | None = None):
        self.params = params
        self.generator: torch.Generator | None = None
        if not self.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()
        generated = list(generated)
        self.generated = len(generated)
        self.counts = processors.OutputCounts(prompt_ids if params.reads_prompt else (), generated) \
            if processors.has_penalties(params) else None
        self.guide = guide
        self.bias = processors.bias_tensors(params.logit_bias)
        self.stop_ids = None
        if params.min_tokens > self.generated:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            self.stop_ids = torch.tensor(sorted(ids), dtype=torch.long)
        self.logprobs: list[TokenLogprob] = []  # of the tokens chosen since the stage last took them

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Nothing but temperature, top-k, top-p and min-p: a row's pick depends on its logits
        alone (speculative decoding verifies such rows in a batch)."""
        p = self.params
        return self.counts is None and self.guide is None and self.bias is None and self.stop_ids is None \
            and p.logprobs is None

    def sample(self, logits: torch.Tensor) -> int:
        """``logits``: one row, shape ``(vocab,)``. The token chosen counts as generated."""
        if self.plain:
            self.generated += 1
            return self._pick(logits)
        token = self._pick(self.adjusted(logits))
        self.chose(token, logits)
        return token

    def _pick(self, scores: torch.Tensor) -> int:
        if self.greedy:
            return int(torch.argmax(scores))
        probs = self.probabilities(scores)
        if probs is None:
            return int(torch.argmax(scores))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits with the request's processors applied (vLLM's order)."""
        scores = logits.float().clone()
        if self.guide is not None:
            self.guide.mask(scores)
        if self.stop_ids is not None and self.generated < self.params.min_tokens:
            processors.block_stops(scores, self.stop_ids)
        if self.bias is not None:
            processors.add_bias(scores, self.bias)
        if self.counts is not None:
            self.counts.penalize(scores, self.params)
        return scores

    def chose(self, token: int, logits: torch.Tensor | None = None) -> None:
        """``token`` is the request's next output token (``logits``: the raw row it came from,
        for its logprobs)."""
        self.generated += 1
        if self.params.logprobs is not None and logits is not None:
            self.logprobs.append(token_logprob(logits, token, self.params.logprobs))
        if self.counts is not None:
            self.counts.add(token)
        if self.guide is not None:
            self.guide.accept(token)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens chosen since the last call."""
        taken, self.logprobs = self.logprobs, []
        return taken

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The distribution :meth:`sample` draws from for one row of ``logits`` (temperature,
        top-k and top-p applied), or None where none can be drawn from (greedy sampling, or
        logits that are not finite: the argmax is then the token)."""
        if self.greedy:
            return None
        p = self.params
        scores = logits.float()
        scores = (scores - scores.max()) / p.temperature  # the top score is 0: nothing overflows
        scores = processors.keep_min_p(scores, p.min_p)
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
    """One token per row; plain greedy rows share one argmax."""
    greedy = kernels.argmax_rows(logits)
    picks = []
    for i, (g, s) in enumerate(zip(greedy, samplers)):
        if s.greedy and s.plain:
            s.generated += 1
            picks.append(g)
        else:
            picks.append(s.sample(logits[i]))
    return picks


class SamplerFactory:
    """Makes each request's :class:`Sampler` in a stage that samples (prefill, decode, the
    colocated worker), with the model's end-of-sequence ids and, for guided requests, a guide
    compiled against its tokenizer (in ``model_dir``)."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int, model_dir=None):
        self.eos_token_ids = eos_token_ids
        self.guides = GuideCompiler(model_dir, vocab_size, eos_token_ids) if model_dir is not None else None

    @property
    def warm(self) -> bool:
        """Whether a guided request's sampler is quick to make (the grammar engine is loaded)."""
        return self.guides is None or self.guides.loaded

    def warm_up(self) -> None:
        """Load the grammar engine for this model now (a blocking fraction of a second, once)."""
        if self.guides is not None:
            self.guides.load()

    def make(self, params: SamplingParams, prompt_ids: Iterable[int] = (), generated: Iterable[int] = ()) -> Sampler:
        """``generated``: the output tokens chosen before this sampler's first."""
        generated = list(generated)
        guide = None
        if params.guide:
            if self.guides is None:
                raise ValueError("this sampler factory has no tokenizer for guided decoding")
            guide = self.guides.guide(params.guide, generated)
        return Sampler(params, self.eos_token_ids, prompt_ids, generated, guide)
