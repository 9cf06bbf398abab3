"""How much a batch drafts, and one speculative step.

:class:`Speculation` holds the proposer and decides each sequence's budget (tokens it may draft
this step):

- never past the request's ``max_tokens`` (the target's own token always follows the draft) or
  the model's context;
- **adaptive** (on by default): each sequence keeps a decaying count of draft tokens accepted and
  of rejections, estimates the chance ``a`` that a draft token is accepted (their ratio; 0.8
  before any evidence), and drafts the ``k`` (up to
  ``num_tokens``) that maximizes the tokens a step yields per its cost, ``(1 - a^(k+1)) / (1 - a)``
  over ``1 + c * k``, where ``c`` is what one more verified row costs against the sequence's share
  of a step: ``row_cost`` (one more row against a one-row step; 0.25 by default, as measured here
  with the default ``int4-a16-blocked`` weights: a 400-token sequence's pass took 4.6 ms for one
  row, 5.6 for two, 8.3 for four, 14.8 for eight, 0.21-0.31 a further row,
  experiments/profile_verify_rows.py; 0.4 with ``int4-a16``) at batch 1, rising with the batch, ``row_cost * B / (1 + row_cost * (B -
  1))`` (0.73 at batch 8): on a CPU already computing, not waiting on memory, more rows cost about
  what they add, so a larger batch drafts only where nearly every draft token is kept. A sequence whose drafts keep failing drafts nothing;
  every ``probe_every`` steps it drafts one token again, to notice when its output starts
  repeating. So speculation costs a workload it does not fit little more than the probes;
- **the batch's rows**: a verify pass feeds every sequence its next token and its draft, one row
  each; they are kept within ``max_rows`` (64: one call into pdflow's kernels, whose decode step
  takes at most 64 rows), trimming the longest drafts first. A full batch (``max_rows``
  sequences or more) drafts nothing: each of its rows already shares the weights' read, which is
  what speculation would otherwise buy.
- a sequence whose sampler is not plain (penalties, bias, ``min_tokens``, a guide, logprobs:
  each token's pick depends on the tokens before it) drafts nothing and samples as in a plain step.

:func:`speculative_step` is the step itself, for any batch that can run a forward pass over rows
of its sequences (``forward(owners, offsets, tokens)``: row *r* is token ``tokens[r]`` of
sequence ``owners[r]``, ``offsets[r]`` places after its ``next_token``'s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow.speculative.base import NO_DRAFT, Draft, Proposer
from pdflow.speculative.verify import accept

if TYPE_CHECKING:
    from pdflow.engine.decode import Sequence

__all__ = ["ROW_COST", "Speculation"]

ROW_COST = 0.25  # one more row of a verify pass against a whole one-row step (see the module doc)
_DECAY = 0.9  # how much of a sequence's acceptance history each verify keeps
_PRIOR = (0.4, 0.5)  # before any verify: half a verify's worth of evidence that 80% of drafts are kept


class Speculation:
    def __init__(self, proposer: Proposer, num_tokens: int = 5, adaptive: bool = True, max_rows: int = 64,
                 row_cost: float = ROW_COST, probe_every: int = 8) -> None:
        for name, value, least in (("num_tokens", num_tokens, 1), ("max_rows", max_rows, 2),
                                   ("probe_every", probe_every, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"speculative.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(row_cost, (int, float)) or isinstance(row_cost, bool) or not 0 <= row_cost < float("inf"):
            raise ValueError(f"speculative.row_cost must be a number >= 0, got {row_cost!r}")
        self.proposer, self.num_tokens, self.adaptive = proposer, num_tokens, bool(adaptive)
        self.max_rows, self.row_cost, self.probe_every = max_rows, float(row_cost), probe_every
        self.counts = {"steps": 0, "speculative_steps": 0, "drafts": 0, "proposed": 0, "accepted": 0}

    # ---- how many tokens each sequence drafts ----

    def row_cost_in(self, batch: int) -> float:
        """One more verified row against one sequence's share of a ``batch``-sequence step: a
        step of ``B`` rows costs about ``1 + row_cost * (B - 1)`` one-row steps, a sequence's
        share of it that over ``B``, and a draft token kept saves the sequence that share."""
        return self.row_cost * batch / (1 + self.row_cost * (batch - 1))

    def wanted(self, seq: "Sequence", row_cost: float | None = None) -> int:
        """Tokens ``seq`` drafts this step, by its acceptance so far and what a row costs
        (``row_cost``: against its share of a step; the one-row figure if None); all of
        ``num_tokens`` when not adaptive."""
        cost = (self.row_cost if row_cost is None else row_cost) + self.proposer.draft_cost
        state = seq.acceptance
        if not self.adaptive:
            return self.num_tokens
        a = (state.kept + _PRIOR[0]) / (state.kept + state.missed + _PRIOR[1])
        best, best_rate = 0, 1.0
        for k in range(1, self.num_tokens + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / (1 + cost * k) if a < 1 else (k + 1) / (1 + cost * k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            state.idle += 1
            if state.idle >= self.probe_every:
                state.idle = 0
                return 1
        return best

    def budgets(self, seqs: "list[Sequence]", max_context: int) -> list[int]:
        cost = self.row_cost_in(len(seqs))
        budgets = [max(0, min(self.wanted(seq, cost), seq.sampler.params.max_tokens - seq.generated - 1,
                              max_context - 1 - seq.position)) if seq.sampler.plain else 0 for seq in seqs]
        rows = len(seqs) + sum(budgets)
        while rows > self.max_rows and any(budgets):  # the longest drafts give way first
            i = max(range(len(budgets)), key=budgets.__getitem__)
            budgets[i] -= 1
            rows -= 1
        return budgets

    def drafts(self, batch, seqs: "list[Sequence]", max_context: int) -> list[Draft]:
        budgets = self.budgets(seqs, max_context)
        if not any(budgets):
            return [NO_DRAFT] * len(seqs)
        drafts = self.proposer.propose(batch, seqs, budgets)
        return [Draft(d.tokens[:b], None if d.probs is None else d.probs[:b]) if len(d.tokens) > b else d
                for d, b in zip(drafts, budgets)]

    def record(self, seq: "Sequence", proposed: int, accepted: int) -> None:
        """A verify kept ``accepted`` of the ``proposed`` draft tokens of ``seq``."""
        seq.proposed += proposed
        seq.accepted += accepted
        self.counts["drafts"] += proposed > 0
        self.counts["proposed"] += proposed
        self.counts["accepted"] += accepted
        if proposed:
            state = seq.acceptance
            state.kept = state.kept * _DECAY + accepted
            state.missed = state.missed * _DECAY + (accepted < proposed)

    def step(self, batch, seqs: "list[Sequence]", forward, max_context: int) -> list[tuple["Sequence", int]]:
        """One step of ``batch``'s sequences ``seqs``: drafts, one verify pass over every sequence's
        rows (``forward(owners, offsets, tokens)``: the batch's logits of those rows), the tokens
        each keeps (several per sequence, in order, as ``(sequence, token)`` pairs)."""
        drafts = self.drafts(batch, seqs, max_context)
        self.counts["steps"] += 1
        self.counts["speculative_steps"] += any(d.tokens for d in drafts)
        owners, offsets, tokens = [], [], []
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            for j, token in enumerate([seq.next_token, *draft.tokens]):
                owners.append(i)
                offsets.append(j)
                tokens.append(token)
        logits = forward(owners, offsets, tokens)
        out, row = [], 0
        for seq, draft in zip(seqs, drafts):
            n = len(draft.tokens) + 1
            # a sequence with logits processors, a guide or logprobs drafts nothing: it samples as in a plain step
            emitted = accept(logits[row : row + n], draft, seq.sampler) if seq.sampler.plain \
                else [seq.sampler.sample(logits[row])]
            row += n
            self.record(seq, n - 1, len(emitted) - 1)
            seq.length += len(emitted)  # the tokens fed and kept are cached now; the last emitted is fed next
            seq.generated += len(emitted)
            seq.next_token = emitted[-1]
            if seq.history is not None:
                seq.history.extend(emitted)
            out.extend((seq, token) for token in emitted)
        return out

    def forget(self, seq: "Sequence") -> None:
        self.proposer.forget(seq)

    def stats(self) -> dict[str, int]:
        """Counters for a stage's /health: steps, those that verified a draft, drafts verified
        (one per sequence and step), draft tokens proposed and accepted."""
        return {f"speculative_{name}": value for name, value in self.counts.items()}
