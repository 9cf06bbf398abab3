"""What a model's KV cache is made of: layers, kv heads, head size, and how attention keeps it.

A :class:`ModelShape` comes from a Hugging Face ``config.json`` (:func:`from_config`, any local
model directory) or from :data:`KNOWN`, a table of common models with the numbers of their
published configs. Two kinds of attention are covered:

- ``"gqa"`` (multi-head, grouped-query and multi-query alike): each layer keeps a key and a value
  of ``kv_heads x head_dim`` per token;
- ``"mla"`` (DeepSeek-V2/V3's multi-head latent attention): each layer keeps one compressed
  latent of ``kv_lora_rank`` plus a shared rotary key of ``qk_rope_head_dim`` per token, and
  rebuilds keys and values from it (``latent_dim`` below is their sum).

pdflow's own store and codecs handle ``gqa`` models only; an ``mla`` shape is sized here for
planning, and the codec rows say it is not covered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOWN", "ModelShape", "from_config", "lookup", "read_json"]


def read_json(path: Path):
    """The JSON in ``path``; ValueError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int  # gqa: per layer; mla: 1 (the latent is shared by every head)
    head_dim: int  # gqa: per kv head; mla: the latent's width (kv_lora_rank + qk_rope_head_dim)
    attention: str = "gqa"  # "gqa" or "mla"
    parameters: float | None = None  # billions, where known (for the table only)
    default_dtype: str = "bfloat16"  # what its weights ship in (and its KV is kept in by default)
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"{self.name}: attention must be 'gqa' or 'mla', not {self.attention!r}")
        for field in ("layers", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")

    @property
    def elements_per_token(self) -> int:
        """KV elements one token adds, over every layer (gqa: keys and values)."""
        per_layer = self.kv_heads * self.head_dim
        return self.layers * per_layer * (2 if self.attention == "gqa" else 1)


_HF = "the model's config.json on Hugging Face"
KNOWN: dict[str, ModelShape] = {shape.name: shape for shape in (
    ModelShape("smollm2-135m", 30, 3, 64, parameters=0.135, source=_HF + " (pdflow's default model)"),
    ModelShape("llama-3-8b", 32, 8, 128, parameters=8.0, source=_HF),
    ModelShape("llama-3-70b", 80, 8, 128, parameters=70.6, source=_HF),
    ModelShape("llama-3.1-405b", 126, 8, 128, parameters=405.0, source=_HF),
    ModelShape("qwen2.5-7b", 28, 4, 128, parameters=7.6, source=_HF),
    ModelShape("qwen2.5-72b", 80, 8, 128, parameters=72.7, source=_HF),
    ModelShape("mistral-7b", 32, 8, 128, parameters=7.2, source=_HF),
    ModelShape("deepseek-v3", 61, 1, 512 + 64, attention="mla", parameters=671.0,
               source=_HF + ": kv_lora_rank 512 + qk_rope_head_dim 64 per layer"),
)}
_ALIASES = {"smollm2": "smollm2-135m", "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b",
            "llama-3.3-70b": "llama-3-70b", "deepseek-r1": "deepseek-v3"}


def from_config(path: str | Path) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (or the directory holding one). ValueError
    naming the file and the key when it lacks what sizing needs."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = read_json(path)
    config = config.get("text_config", config)  # multimodal configs nest the language model's

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
        return value

    name = path.parent.name or str(path)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    layers = need("num_hidden_layers")
    if "kv_lora_rank" in config:  # DeepSeek-V2/V3: multi-head latent attention
        return ModelShape(name, layers, 1, need("kv_lora_rank") + need("qk_rope_head_dim"), attention="mla",
                          default_dtype=dtype, source=str(path))
    heads = need("num_attention_heads")
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in config else heads
    head_dim = need("head_dim") if config.get("head_dim") is not None else need("hidden_size") // heads
    return ModelShape(name, layers, kv_heads, head_dim, default_dtype=dtype, source=str(path))


def lookup(model: str) -> ModelShape:
    """A model by its name in :data:`KNOWN` (case-insensitive), else a local directory or
    ``config.json``. ValueError listing the known names when it is neither."""
    key = model.lower()
    key = _ALIASES.get(key, key)
    if key in KNOWN:
        return KNOWN[key]
    if Path(model).exists():
        return from_config(model)
    raise ValueError(f"unknown model {model!r}: give a local model directory or config.json, or one of "
                     f"{', '.join(KNOWN)}")
