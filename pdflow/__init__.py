"""pdflow: disaggregated LLM inference. Prefill and decode run in separate processes and the KV
cache streams from one to the other layer by layer while prefill is still computing.

The public API (imported lazily, so ``import pdflow`` stays light)::

    from pdflow import Pipeline, Stage, Router, LocalPipeline, run
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Pipeline": "pdflow.config.pipeline",
    "PipelineError": "pdflow.config.pipeline",
    "StageConfig": "pdflow.config.pipeline",
    "load_topology": "pdflow.config.topology",
    "check_pipeline": "pdflow.config.checks",
    "Stage": "pdflow.runtime.stage",
    "StageContext": "pdflow.runtime.stage",
    "Submission": "pdflow.runtime.stage",
    "Message": "pdflow.messages",
    "Router": "pdflow.routing.base",
    "ReplicaStatus": "pdflow.routing.base",
    "RoutingRequest": "pdflow.routing.base",
    "LocalPipeline": "pdflow.runtime.local",
    "MemoryHub": "pdflow.runtime.memory_bus",
    "run": "pdflow.runtime.launcher",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pdflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
