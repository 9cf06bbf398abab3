"""The in-process reference for what a server answers: the engine's greedy answer to a prompt,
decode attending over the prompt's KV as a link's codec lets it have it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Past", "chat_ids", "greedy_answer"]


class Past(NamedTuple):
    """A prompt's KV as decode would attend with it: per layer, the kept tokens' keys and values
    (token-major), the prompt's length (the next token's position) and which kv heads are kept
    (None: all; else bool ``(layers, kv_heads)``)."""

    keys: list
    values: list
    length: int
    kv_keep: object = None


def chat_ids(tokenizer, question: str) -> list[int]:
    """``question`` as one user message, templated and tokenized as a server does."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def greedy_answer(loaded, tokenizer, ids: list[int], max_tokens: int, through: Callable | None = None) -> str:
    """The greedy answer (at most ``max_tokens`` tokens, ending at end of sequence) of prefill and
    a decode batch without speculation. ``through(keys, values)``: what decode gets of the
    prompt's KV (per layer, token-major), a :class:`Past` (e.g.
    ``compressed(codec, keys, values, block_tokens)``); None: all of it as prefill computed it."""
    import torch

    from pdflow.engine import DecodeBatch, Sampler, Sequence, prefill
    from pdflow.messages import SamplingParams

    sampler = Sampler(SamplingParams(max_tokens=max_tokens, temperature=0))
    kv = {}
    first = prefill(loaded, ids, sampler, lambda layer, k, v: kv.__setitem__(layer, (k.clone(), v.clone())))
    keys, values = ([kv[layer][i] for layer in range(loaded.num_layers)] for i in (0, 1))
    past = Past(keys, values, len(ids)) if through is None else through(keys, values)
    batch = DecodeBatch(loaded, max_batch=1)
    if past.kv_keep is not None:
        batch.kv_keep = past.kv_keep.to(torch.uint8)
    kept = past.keys[0].shape[0]
    batch.add(Sequence("reference", kept, first.first_token, sampler, skipped=len(ids) - kept),
              lambda layer: (past.keys[layer].transpose(0, 1), past.values[layer].transpose(0, 1)))
    tokens = [first.first_token]
    while len(tokens) < max_tokens and tokens[-1] not in loaded.eos_token_ids:
        tokens.extend(token for _, token in batch.step())
    return tokenizer.decode([t for t in tokens[:max_tokens] if t not in loaded.eos_token_ids],
                            skip_special_tokens=True)
