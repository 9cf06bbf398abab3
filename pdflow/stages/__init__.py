"""The built-in stages, named as ``"module:Class"`` and imported only when a process needs one."""

from __future__ import annotations

import importlib

BUILTIN: dict[str, str] = {
    "ingress": "pdflow.stages.ingress:IngressStage",
    "prefill": "pdflow.stages.prefill:PrefillStage",
    "kv_shuttle": "pdflow.stages.kv_shuttle:KvShuttleStage",
    "decode": "pdflow.stages.decode:DecodeStage",
    "egress": "pdflow.stages.egress:EgressStage",
    "worker": "pdflow.stages.worker:WorkerStage",
}


def load_stage(name: str) -> type:
    target = BUILTIN.get(name)
    if target is None:
        raise LookupError(f"unknown stage {name!r}; built-in: {', '.join(BUILTIN)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
