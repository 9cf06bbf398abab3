"""Load a Hugging Face causal LM directory for pdflow's loops."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pdflow.plugins import DEFAULT_WEIGHTS
from pdflow.engine import packed_cache
from pdflow.engine import weights as weight_formats
from pdflow.engine.forward import TransformersForward, check_against_own_forward
from pdflow.engine.llama import CompactLlama, unsupported_reason
from pdflow.kv.layout import KvLayout, torch_dtype
from pdflow.log import quiet_transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub at run time


@dataclass(slots=True)
class LoadedModel:
    """``model`` is called as ``model(input_ids, positions, mask, cache)`` -> last logits."""

    model: CompactLlama | TransformersForward
    layout: KvLayout
    eos_token_ids: frozenset[int]
    max_context: int
    device: torch.device
    weights: str = DEFAULT_WEIGHTS
    vocab_size: int = 0  # the width of a row of logits

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers


def _eos_ids(model_dir: Path, config) -> frozenset[int]:
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        ids.append(gen.eos_token_id)
    except OSError:
        pass
    ids.append(getattr(config, "eos_token_id", None))
    flat: set[int] = set()
    for item in ids:
        if isinstance(item, int):
            flat.add(item)
        elif isinstance(item, (list, tuple)):
            flat.update(int(i) for i in item)
    return frozenset(flat)


# transformers builds a model on the meta device under a process-wide switch, so two loads at once
# in one process (prefill and decode of a LocalPipeline) corrupt each other: one at a time
_LOADING = threading.Lock()


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
               weights: str = DEFAULT_WEIGHTS) -> LoadedModel:
    """Load a model for pdflow's loops: the compact engine with ``weights`` (a weight format's
    name) where it can run the model, else transformers' own layers in ``dtype`` (``weights``
    must then be ``fp32`` or the default). ``dtype`` is the activations' and the KV cache's."""
    model_dir, target = Path(model_dir), torch.device(device)
    fmt = weight_formats.registry.load(weights)()
    kept = packed_cache.path_for(model_dir, weights, torch_dtype(dtype)) if packed_cache.enabled(target) else None
    if kept is not None and (found := packed_cache.load(kept, fmt, torch_dtype(dtype), target)) is not None:
        forward, config, eos_ids = found  # no transformers import: seconds off a stage's start
        return LoadedModel(forward, KvLayout.from_config(config, dtype), eos_ids,
                           int(getattr(config, "max_position_embeddings", 2048)), target, weights,
                           int(config.vocab_size))
    from transformers import AutoConfig

    quiet_transformers()
    config = AutoConfig.from_pretrained(model_dir)
    compact = unsupported_reason(config) is None
    if compact:
        with _LOADING:  # the compact engine packs from fp32 whatever it computes in
            hf_model = load_transformers_model(model_dir, "float32", device)
        forward = CompactLlama(hf_model, fmt, torch_dtype(dtype), target)
        del hf_model  # the compact engine holds its own (packed) copies
        if kept is not None:
            packed_cache.store(kept, forward, config.to_dict(), _eos_ids(model_dir, config))
    elif weights not in ("fp32", DEFAULT_WEIGHTS):  # the default falls back quietly; a choice does not
        raise ValueError(f"weights = {weights!r} needs the compact engine, which cannot run this model: "
                         f"{unsupported_reason(config)}; use weights = \"fp32\"")
    else:
        with _LOADING:
            hf_model = load_transformers_model(model_dir, dtype, device)
        config = hf_model.config
        forward, weights = TransformersForward(hf_model), "fp32"
        check_against_own_forward(forward)  # a mismatch is an error here, not wrong text later
    return LoadedModel(
        model=forward,
        layout=KvLayout.from_config(config, dtype),
        eos_token_ids=_eos_ids(model_dir, config),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        device=torch.device(device),
        weights=weights,
        vocab_size=int(config.vocab_size),
    )


def load_transformers_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """transformers' own model (sdpa attention, eval mode, on ``device``): the reference the
    engine is tested against, and the source of its weights."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=torch_dtype(dtype), attn_implementation="sdpa")
    return model.to(device).eval()
