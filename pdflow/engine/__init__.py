"""The model engine: transformers' layers run by pdflow's own prefill and decode loops."""

from pdflow.engine.decode import DecodeBatch, Sequence
from pdflow.engine.loader import LoadedModel, load_model
from pdflow.tokenizing import load_tokenizer
from pdflow.engine.prefill import PrefillResult, prefill
from pdflow.engine.sampler import Sampler, SamplerFactory

__all__ = [
    "DecodeBatch",
    "LoadedModel",
    "PrefillResult",
    "Sampler",
    "SamplerFactory",
    "Sequence",
    "load_model",
    "load_tokenizer",
    "prefill",
]
