"""Log-probabilities of chosen tokens and their most likely alternatives, from raw logits.

They are the model's own distribution (fp32 ``log_softmax`` of the logits, before penalties,
bias, grammar and temperature), as vLLM's default ``raw_logprobs`` and lm-evaluation-harness's
loglikelihood expect.
"""

from __future__ import annotations

import torch

from pdflow.messages import TokenLogprob

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs and OpenAI's top_logprobs


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under one row of ``logits`` ``(vocab,)``, and the ``top``
    most likely tokens' (0: none)."""
    return rows_logprobs(logits[None], [token], top)[0]


def rows_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row *i* of ``logits`` ``(rows, vocab)`` scores ``tokens[i]``."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(lp, i, v) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
    """The prompt's tokens from the second on, each scored by the row before it (``logits``
    ``(tokens, vocab)``, one row per prompt position, in chunks to bound the memory)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(prompt_ids) - 1, 256):
        end = min(start + 256, len(prompt_ids) - 1)
        out += rows_logprobs(logits[start:end], prompt_ids[start + 1 : end + 1], top)
    return out
