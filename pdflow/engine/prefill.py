"""Prefill one prompt, handing each layer's keys and values out the moment they exist.

With a cached prefix, only the tokens after it are computed; layer *l* takes the prefix's keys and
values of layer *l* as its past (``past(l)`` may block until they have arrived, so layer 0 computes
while later layers' prefix is still on the wire).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdflow.engine.forward import causal_mask
from pdflow.engine.llama import Target
from pdflow.engine.loader import LoadedModel
from pdflow.engine.logprobs import prompt_logprobs
from pdflow.engine.sampler import Sampler
from pdflow.kv.layout import torch_dtype
from pdflow.messages import TokenLogprob

# (layer, keys, values), both token-major (tokens, kv_heads, head_dim) and contiguous -> None
LayerSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# layer -> the cached prefix's (keys, values) of that layer, token-major; may block until they are here
PastSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# layer -> where that layer's keys and values are computed (runs of rows and their memory, see
# pdflow.engine.llama.Target); may raise to stop the prefill (a cancelled request)
TargetSource = Callable[[int], list[Target]]
# layer -> the keys and values of every token so far (the cached prefix and the new ones, written
# by then), token-major: what the layer attends over when its KV is computed in place
AttendedSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class LayerStreamingCache:
    """A cache that keeps nothing: ``update`` is called by layer *l*'s attention with that layer's
    final keys and values, which go straight to ``sink`` while layer *l* (and *l+1*, ...) go on
    computing; with ``past``, the layer then attends over the prefix's KV and its own. Values go
    out in the memory the projection wrote them to (token-major); keys, which rotary embedding
    writes head-major, are transposed once. With ``targets`` the layers compute their keys and
    values straight into the memory it names (the KV store's blocks), which ``sink`` then gets,
    and attend over what ``attended`` gives (the prefix and the new tokens where they are)."""

    def __init__(self, sink: LayerSink, past: PastSource | None = None, targets: TargetSource | None = None,
                 attended: AttendedSource | None = None):
        self.sink, self.past, self.attended = sink, past, attended
        if targets is not None:
            self.targets = targets
        self.layer_done: list[float] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_):
        keys = key_states[0].transpose(0, 1)
        values = value_states[0].transpose(0, 1)
        if not keys.is_contiguous():
            keys = keys.contiguous()
        if not values.is_contiguous():
            values = values.contiguous()
        self.layer_done.append(time.monotonic())
        self.sink(layer_idx, keys, values)
        if self.attended is not None:
            keys, values = self.attended(layer_idx)
            return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        if self.past is not None:
            past_keys, past_values = self.past(layer_idx)
            key_states = torch.cat([past_keys.transpose(0, 1).unsqueeze(0), key_states], dim=2)
            value_states = torch.cat([past_values.transpose(0, 1).unsqueeze(0), value_states], dim=2)
        return key_states, value_states


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    layer_done: list[float] = field(default_factory=list)  # time.monotonic() per layer
    started: float = 0.0
    finished: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the first token's, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the prompt's, from its second token


def prefill(loaded: LoadedModel, prompt_ids: list[int], sampler: Sampler, sink: LayerSink,
            past: PastSource | None = None, start: int = 0, targets: TargetSource | None = None,
            attended: AttendedSource | None = None) -> PrefillResult:
    """Run the prompt (after its first ``start`` tokens, whose KV ``past`` gives) through the
    model (blocking; call it from a worker thread). ``sink`` gets the KV of tokens ``start ..``,
    computed where ``targets`` says if given (the compact engine only; each layer then attends
    over ``attended``'s keys and values of the whole prompt so far instead of ``past``'s)."""
    started = time.monotonic()
    device = loaded.device
    input_ids = torch.tensor([prompt_ids[start:]], dtype=torch.long, device=device)
    position_ids = torch.arange(start, len(prompt_ids), device=device).unsqueeze(0)
    mask = causal_mask(start, len(prompt_ids), device, torch_dtype(loaded.layout.dtype))
    cache = LayerStreamingCache(sink, past if start else None, targets, attended)
    top = sampler.params.prompt_logprobs
    if top is not None and start:
        raise ValueError("prompt logprobs need the whole prompt computed (no cached prefix)")
    scored: list[TokenLogprob] = []
    if top is None:
        logits = loaded.model(input_ids, position_ids, mask, cache)[0]
    else:
        every = loaded.model(input_ids, position_ids, mask, cache, every_position=True)[0]
        scored, logits = prompt_logprobs(every, prompt_ids, top), every[-1]
    token = sampler.sample(logits)
    return PrefillResult(token, cache.layer_done, started, time.monotonic(), sampler.take_logprobs(), scored)
