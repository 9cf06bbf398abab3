"""The forward pass through transformers' own layers, for models the compact engine cannot run.

pdflow calls the decoder layers itself (instead of ``model.forward``) so that it controls the
attention mask and the cache object: prefill hands each layer's keys and values to the data plane
from ``cache.update``; decode keeps a batch of sequences of different lengths in one buffer.
Every engine forward (this one, :class:`pdflow.engine.llama.CompactLlama`) is called as
``forward(input_ids, positions, mask, cache)`` and returns each row's last logits.
"""

from __future__ import annotations

import torch


class TransformersForward:
    """A transformers causal LM run layer by layer (weights in the model's own dtype)."""

    def __init__(self, hf_model: torch.nn.Module):
        self.hf_model = hf_model
        self.weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, every_position: bool = False) -> torch.Tensor:
        """Run all layers; return the logits of each row's last position, shape ``(batch, vocab)``
        (with ``every_position``: of every position, ``(batch, tokens, vocab)``).

        ``attention_mask`` is ``None`` (plain causal, no padding) or an additive 4-D float mask of
        shape ``(batch, 1, query_len, kv_len)``. ``cache`` is any object with the transformers
        ``update(key_states, value_states, layer_idx, **kwargs) -> (keys, values)`` method.
        """
        model = self.hf_model
        inner = model.model
        hidden = inner.embed_tokens(input_ids)
        position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers[: model.config.num_hidden_layers]:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if every_position:
            return model.lm_head(inner.norm(hidden)).float()
        hidden = inner.norm(hidden[:, -1:, :])
        return model.lm_head(hidden)[:, -1, :].float()

    __call__ = forward


class FallbackMismatch(ValueError):
    """transformers' layers, as pdflow calls them, do not give the model's own logits."""


@torch.inference_mode()
def check_against_own_forward(forward: TransformersForward, tokens: int = 8) -> float:
    """Run a short prompt through ``forward`` and through the model's own ``forward``: their last
    logits must agree (to 1e-3 of the largest in fp32, 5e-2 in half precision), else
    :class:`FallbackMismatch` (an architecture whose forward does more than its layers: an
    embedding scale, soft-capped logits...). Returns the largest difference."""
    from transformers import DynamicCache

    model = forward.hf_model
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = (torch.arange(1, tokens + 1, device=device) * 7919 % vocab)[None]
    positions = torch.arange(tokens, device=device)[None]
    ours = forward(ids, positions, None, DynamicCache(config=model.config))[0].float()
    own = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    difference = float((ours - own).abs().max())
    half = next(model.parameters()).dtype != torch.float32
    if not difference <= (5e-2 if half else 1e-3) * max(1.0, float(own.abs().max())):
        raise FallbackMismatch(
            f"the transformers fallback does not reproduce {type(model).__name__}'s own forward (logits differ "
            f"by up to {difference:.3g} on a {tokens}-token prompt): this architecture is not supported")
    return difference


def causal_mask(start: int, end: int, device, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask for queries at positions ``start .. end`` over keys ``0 .. end`` (a
    prompt's tail after ``start`` cached tokens), ``(1, 1, end - start, end)``; None when
    ``start == 0`` (plain causal attention needs none)."""
    if not start:
        return None
    positions = torch.arange(start, end, device=device)
    visible = torch.arange(end, device=device)[None, :] <= positions[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]
