"""Load a Hugging Face causal LM directory for pdflow's loops."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pdflow.kv.layout import KvLayout, torch_dtype

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub at run time


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    layout: KvLayout
    eos_token_ids: frozenset[int]
    max_context: int
    device: torch.device

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


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    with _LOADING:
        return _load_model(model_dir, dtype, device)


def _load_model(model_dir: str | Path, dtype: str, device: str) -> LoadedModel:
    """Load weights with sdpa attention, in eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype(dtype), attn_implementation="sdpa"
    )
    model.to(device).eval()
    config = model.config
    return LoadedModel(
        model=model,
        layout=KvLayout.from_config(config, dtype),
        eos_token_ids=_eos_ids(model_dir, config),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        device=torch.device(device),
    )


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(model_dir))
