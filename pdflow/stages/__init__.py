"""The stage kinds: built-in ones named as ``"module:Class"`` and imported only when a process
needs one; third-party ones through the ``pdflow.stages`` entry-point group::

    [project.entry-points."pdflow.stages"]
    redact = "mypkg.redact:RedactStage"
"""

from __future__ import annotations

from pdflow.registry import Registry
from pdflow.runtime.stage import Stage

ENTRY_POINT_GROUP = "pdflow.stages"

BUILTIN: dict[str, tuple[str, str]] = {
    "ingress": ("pdflow.stages.ingress:IngressStage", ""),
    "prefill": ("pdflow.stages.prefill:PrefillStage", ""),
    "kv_shuttle": ("pdflow.stages.kv_shuttle:KvShuttleStage", ""),
    "decode": ("pdflow.stages.decode:DecodeStage", ""),
    "egress": ("pdflow.stages.egress:EgressStage", ""),
    "worker": ("pdflow.stages.worker:WorkerStage", ""),
}

registry = Registry("stage kind", ENTRY_POINT_GROUP, Stage, BUILTIN)
