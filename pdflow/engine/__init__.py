"""The model engine: transformers' layers run by pdflow's own prefill and decode loops."""

from pdflow.engine.decode import DecodeBatch, Sequence
from pdflow.engine.loader import LoadedModel, load_model, load_tokenizer
from pdflow.engine.prefill import PrefillResult, prefill
from pdflow.engine.sampler import Sampler

__all__ = [
    "DecodeBatch",
    "LoadedModel",
    "PrefillResult",
    "Sampler",
    "Sequence",
    "load_model",
    "load_tokenizer",
    "prefill",
]
