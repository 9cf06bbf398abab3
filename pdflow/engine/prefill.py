"""Prefill one prompt, handing each layer's keys and values out the moment they exist."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdflow.engine.forward import logits_of_last_token
from pdflow.engine.loader import LoadedModel
from pdflow.engine.sampler import Sampler

# (layer, keys (kv_heads, tokens, head_dim), values (tokens, kv_heads, head_dim)) -> None
LayerSink = Callable[[int, torch.Tensor, torch.Tensor], None]


class LayerStreamingCache:
    """A cache that keeps nothing: ``update`` is called by layer *l*'s attention with that layer's
    final keys and values, which go straight to ``sink`` while layer *l* (and *l+1*, ...) go on
    computing. Tensors are passed in the memory the model wrote them to (no copy): keys as rotary
    embedding produced them, values as the projection produced them (token-major)."""

    def __init__(self, sink: LayerSink):
        self.sink = sink
        self.layer_done: list[float] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_):
        keys = key_states[0]
        values = value_states[0].transpose(0, 1)
        if not keys.is_contiguous():
            keys = keys.contiguous()
        if not values.is_contiguous():
            values = values.contiguous()
        self.layer_done.append(time.monotonic())
        self.sink(layer_idx, keys, values)
        return key_states, value_states


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    layer_done: list[float] = field(default_factory=list)  # time.monotonic() per layer
    started: float = 0.0
    finished: float = 0.0


def prefill(loaded: LoadedModel, prompt_ids: list[int], sampler: Sampler, sink: LayerSink) -> PrefillResult:
    """Run the prompt through the model (blocking; call it from a worker thread)."""
    started = time.monotonic()
    device = loaded.device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    position_ids = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
    cache = LayerStreamingCache(sink)
    logits = logits_of_last_token(loaded.model, input_ids, position_ids, None, cache)
    token = sampler.sample(logits[0])
    return PrefillResult(token, cache.layer_done, started, time.monotonic())
