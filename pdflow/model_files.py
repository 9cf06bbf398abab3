"""What a model given by path is, before any of it is loaded: its architecture and the engine that
will run it, or why it cannot run. Torch-free (``pdflow validate`` reads only metadata).

- A Hugging Face directory: ``config.json``'s ``model_type`` and settings.
- A GGUF file: its metadata (``general.architecture``, ``{arch}.*``, ``tokenizer.ggml.*``) and
  its tensors' types, read with the ``gguf`` package (memory-mapped: nothing is dequantized).

The compact engine (:mod:`pdflow.engine.llama`) runs llama, mistral and qwen2 models with SiLU,
full attention and plain rotary embeddings; anything else transformers can run goes to the
transformers fallback, which is checked against the model's own forward at load. Refused: a
sliding window (neither engine masks it), and a GGUF's rotary scaling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPACT_TYPES = ("llama", "mistral", "qwen2")
# GGUF tensor types transformers can read: the plain floats and what gguf.quants dequantizes
_FLOAT_TYPES = ("F32", "F16", "BF16")


def compact_unsupported(config: Any) -> str | None:
    """None if the compact engine can run a model of ``config`` (a transformers config, or any
    object with its attributes), else why not."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in COMPACT_TYPES:
        return f"model type {model_type!r} (the compact engine runs {', '.join(COMPACT_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", model_type == "mistral") \
            and window < getattr(config, "max_position_embeddings", window + 1):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        return "dynamic rotary scaling"
    return None


class _Settings:
    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    architecture: str  # the model type: llama, qwen2, ...
    fallback_reason: str | None  # why the compact engine cannot run it (None: it can)
    detail: str = ""  # e.g. a GGUF's tensor types

    @property
    def engine(self) -> str:
        if self.fallback_reason is None:
            return "compact engine"
        return f"transformers fallback ({self.fallback_reason})"


class ModelFileError(ValueError):
    """The model at this path cannot run; the message says why."""


def _refused(reason: str | None) -> None:
    """What no engine of pdflow runs right: pdflow gives the fallback's layers its own attention
    masks (plain causal), so a sliding window would silently attend too far."""
    if reason is not None and reason.startswith("sliding-window"):
        raise ModelFileError(f"{reason}: neither the compact engine nor the transformers fallback (which pdflow "
                             "gives plain causal masks) runs it")


def describe_dir(path: Path) -> ModelFacts:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path / 'config.json'} cannot be read: {exc}") from None
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelFileError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    reason = compact_unsupported(_Settings(config))
    _refused(reason)
    return ModelFacts(str(config.get("model_type", "?")), reason)


def describe_gguf(path: Path) -> ModelFacts:
    """Read a GGUF's metadata; :class:`ModelFileError` for what transformers cannot load from it."""
    import gguf
    from gguf.quants import _type_traits

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from None

    def field(key: str, default: Any = None) -> Any:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    arch = field("general.architecture", "?")
    readable = _gguf_architectures()
    if arch not in readable:
        raise ModelFileError(f"GGUF architecture {arch!r} cannot be read by transformers' GGUF loader "
                             f"(it reads {', '.join(sorted(readable))})")
    if field("tokenizer.ggml.model") is None or field("tokenizer.ggml.tokens") is None:
        raise ModelFileError(f"{path.name} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    dequantized = {t.name for t in _type_traits}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unsupported = [t for t in types if t not in _FLOAT_TYPES and t not in dequantized]
    if unsupported:
        raise ModelFileError(f"{path.name} has tensors of type {', '.join(unsupported)}, which cannot be "
                             f"dequantized (readable: {', '.join([*_FLOAT_TYPES, *sorted(dequantized)])})")
    model_type = "llama" if arch == "llama" else arch  # (mistral GGUFs say llama)
    window = field(f"{arch}.attention.sliding_window")
    scaling = field(f"{arch}.rope.scaling.type", "none")
    settings = _Settings({"model_type": model_type, "sliding_window": window, "use_sliding_window": bool(window)})
    reason = compact_unsupported(settings)
    _refused(reason)
    if scaling not in ("none", None):
        raise ModelFileError(f"rotary scaling {scaling!r} ({arch}.rope.scaling.type): the compact engine does "
                             "plain rotary embeddings only")
    return ModelFacts(model_type, reason, f"tensors {', '.join(types)}")


def _gguf_architectures() -> set[str]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return {arch for arch in GGUF_CONFIG_MAPPING if arch not in ("general", "tokenizer")}


def describe(path: Path) -> ModelFacts:
    """A GGUF file or a Hugging Face directory."""
    return describe_gguf(path) if path.is_file() else describe_dir(path)
