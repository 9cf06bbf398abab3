"""``self-draft``: the target model drafts for itself with its first ``layers`` layers and its own
final norm and head (an early exit, as LayerSkip's self-speculation), one draft token per pass of
those layers. Nothing to load: the draft model is part of the target, and so is its KV: a draft
pass writes the first layers' keys and values of its token where the token would go, and the
verify pass then writes every layer's there (the same values for the first layers, for every
token it keeps), so the draft's KV is always the target's own. Greedy requests draft the early
exit's argmax; sampling requests draw from its distribution (after the request's temperature,
top-k and top-p), which verification's rejection sampling takes into account.

Without training for early exit (LayerSkip trains for it) the first layers of a model predict
its next token poorly: measure with ``pdflow bench speculative --method self-draft``.
"""

from __future__ import annotations

import torch

from pdflow.speculative.base import Draft, Proposer

__all__ = ["SelfDraftProposer"]


class SelfDraftProposer(Proposer):
    name = "self-draft"
    defaults = {"layers": 8}

    def check(self) -> None:
        layers = self._positive_int("layers")
        if self.loaded is None:  # (a topology's check: no model yet)
            return
        if not getattr(self.loaded.model, "early_exit", False):
            raise ValueError("self-draft proposer: the model must run on pdflow's compact engine (an early exit "
                             "through its first layers)")
        if layers >= self.loaded.num_layers:
            raise ValueError(f"self-draft proposer: layers must be fewer than the model's {self.loaded.num_layers}, "
                             f"got {layers}")

    @property
    def draft_cost(self) -> float:
        """The first layers' share of a step, and the head (about a tenth of a step here)."""
        total = self.loaded.num_layers if self.loaded is not None else 30
        return self.params["layers"] / total + 0.1

    def propose(self, batch, seqs, budgets):
        layers = self.params["layers"]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        current = [seq.next_token for seq in seqs]
        active = [i for i, budget in enumerate(budgets) if budget > 0]
        step = 0
        while active:
            logits = batch._forward_rows(active, [step] * len(active), [current[i] for i in active], num_layers=layers)
            still = []
            for row, i in enumerate(active):
                sampler = seqs[i].sampler
                if sampler.greedy:
                    token = int(torch.argmax(logits[row]))
                else:
                    p = sampler.probabilities(logits[row])
                    if p is None:  # nothing to draw from: stop drafting this one
                        continue
                    token = int(torch.multinomial(p, 1, generator=sampler.generator))
                    probs[i].append(p)
                tokens[i].append(token)
                current[i] = token
                if len(tokens[i]) < budgets[i]:
                    still.append(i)
            active = still
            step += 1
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]
