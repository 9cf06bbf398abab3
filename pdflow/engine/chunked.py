"""Prefill a prompt in chunks that keep their KV, for the colocated worker.

The worker interleaves prefill chunks with decode steps (chunked prefill, the strongest
colocated design), so a prompt's KV must persist between chunks in this process. A prompt whose
first tokens' KV came from the store starts after them, with that KV as its past.
"""

from __future__ import annotations

import torch

from pdflow.engine.forward import causal_mask
from pdflow.engine.loader import LoadedModel
from pdflow.engine.logprobs import prompt_logprobs
from pdflow.engine.sampler import Sampler
from pdflow.kv.layout import torch_dtype


class AccumulatingCache:
    """Every layer's keys and values so far, ``(1, kv_heads, tokens, head_dim)``."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_):
        if self.keys[layer_idx] is not None:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states


class ChunkedPrefill:
    """One prompt's prefill, advanced by :meth:`run` a budget of tokens at a time."""

    def __init__(self, loaded: LoadedModel, prompt_ids: list[int], sampler: Sampler, past=None):
        """``past``: per layer, keys and values of the first tokens, token-major ``(tokens,
        kv_heads, head_dim)`` (from the store); prefill starts after them."""
        self.loaded, self.prompt_ids, self.sampler = loaded, prompt_ids, sampler
        self.position = 0
        self.prompt_logprobs = []  # the prompt's tokens' (sampler.params.prompt_logprobs), scored chunk by chunk
        self.cache = AccumulatingCache(loaded.num_layers)
        if past is not None:
            keys, values = past
            for layer in range(loaded.num_layers):
                self.cache.keys[layer] = keys[layer].transpose(0, 1).unsqueeze(0)
                self.cache.values[layer] = values[layer].transpose(0, 1).unsqueeze(0)
            self.position = keys[0].shape[0]

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.position

    def run(self, budget: int) -> int | None:
        """Prefill up to ``budget`` more prompt tokens (blocking); once the prompt is done, the
        first output token, else None."""
        start, end = self.position, min(len(self.prompt_ids), self.position + budget)
        device = self.loaded.device
        input_ids = torch.tensor([self.prompt_ids[start:end]], device=device)
        positions = torch.arange(start, end, device=device).unsqueeze(0)
        mask = causal_mask(start, end, device, torch_dtype(self.loaded.layout.dtype))
        top = self.sampler.params.prompt_logprobs
        if top is None:
            logits = self.loaded.model(input_ids, positions, mask, self.cache)[0]
        else:  # each position scores the prompt's next token (the last one: the chunk after, or none)
            every = self.loaded.model(input_ids, positions, mask, self.cache, every_position=True)[0]
            self.prompt_logprobs += prompt_logprobs(every, self.prompt_ids[start : end + 1], top)
            logits = every[-1]
        self.position = end
        return self.sampler.sample(logits) if end == len(self.prompt_ids) else None

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The finished prompt's keys and values of ``layer``, each ``(kv_heads, tokens, head_dim)``."""
        return self.cache.keys[layer][0], self.cache.values[layer][0]

    def token_major(self, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, keys and values of tokens ``start .. end``, token-major (views)."""
        keys = [k[0, :, start:end].transpose(0, 1) for k in self.cache.keys]
        values = [v[0, :, start:end].transpose(0, 1) for v in self.cache.values]
        return keys, values
