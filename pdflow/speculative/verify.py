"""Which drafted tokens a sequence keeps, from the target's logits at each drafted position.

Row *i* of ``logits`` is the target's prediction after the *i*-th token fed (row 0: after the
sequence's ``next_token``, rows 1..k: after each draft token). Greedy: draft tokens are kept while
each is the target's argmax, then the target's own token follows, so the output is token for
token what decoding without a draft gives. Sampling: each draft token ``x`` is kept with
probability ``min(1, p(x) / q(x))`` (``p`` the target's distribution after the sampler's
temperature, top-k and top-p; ``q`` the draft's, one-hot for a token picked outright); at the
first rejection the token is drawn from ``max(p - q, 0)`` renormalized, and if every draft token
is kept one more is drawn from the last row. Then every output token is distributed as the
target's (Leviathan et al., 2023; Chen et al., 2023). Randomness comes from the request's own
generator, so a seeded request is reproducible (though not the same draws as without a draft).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow import kernels
from pdflow.speculative.base import Draft

if TYPE_CHECKING:
    import torch

    from pdflow.engine.sampler import Sampler

__all__ = ["accept"]


def accept(logits: torch.Tensor, draft: Draft, sampler: Sampler) -> list[int]:
    """The tokens the sequence emits this step: the draft tokens kept and one of the target's
    (``logits`` ``(len(draft.tokens) + 1, vocab)``)."""
    tokens = draft.tokens
    if sampler.greedy:
        target = kernels.argmax_rows(logits)  # the same pick as a plain step's (sample_batch)
        kept = 0
        while kept < len(tokens) and tokens[kept] == target[kept]:
            kept += 1
        return tokens[:kept] + [target[kept]]
    import torch  # (here, not at the top: a launcher checks a topology's proposer through this module)

    out = []
    for i, token in enumerate(tokens):
        p = sampler.probabilities(logits[i])
        if p is None:  # nothing to draw from (logits not finite): the argmax, as the sampler does
            best = int(torch.argmax(logits[i]))
            if best != token:
                return out + [best]
            out.append(token)
            continue
        q_token = 1.0 if draft.probs is None else float(draft.probs[i, token])
        if q_token > 0 and float(torch.rand((), generator=sampler.generator)) * q_token < float(p[token]):
            out.append(token)
            continue
        if draft.probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - draft.probs[i].to(p.dtype)).clamp_(min=0)
        total = float(residual.sum())
        if total <= 0:  # p puts everything where q does: any draw of p is the draft token
            return out + [token]
        return out + [int(torch.multinomial(residual / total, 1, generator=sampler.generator))]
    return out + [sampler.sample(logits[len(tokens)])]
