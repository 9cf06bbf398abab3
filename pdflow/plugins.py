"""Every plug-in kind's registry, torch-free and importing none of its implementations: the
built-in ones by ``"module:Class"`` name with an install hint, third-party ones through each
kind's entry-point group (see :mod:`pdflow.registry`). The topology's checks look plug-ins up
here without importing the engine, the stages or a transport; each plug-in package re-exports
its kind's registry (``pdflow.transports.registry`` is ``transports`` here).
"""

from __future__ import annotations

from pdflow.registry import Registry

STAGE_KINDS = {
    "ingress": ("pdflow.stages.ingress:IngressStage", ""),
    "prefill": ("pdflow.stages.prefill:PrefillStage", ""),
    "kv_shuttle": ("pdflow.stages.kv_shuttle:KvShuttleStage", ""),
    "decode": ("pdflow.stages.decode:DecodeStage", ""),
    "egress": ("pdflow.stages.egress:EgressStage", ""),
    "worker": ("pdflow.stages.worker:WorkerStage", ""),
}
TRANSPORTS = {
    "tcp": ("pdflow.transports.tcp:TcpTransport", ""),
    "inproc": ("pdflow.transports.inproc:InProcTransport", ""),
    "shm": ("pdflow.transports.shm:ShmTransport", "needs Linux (memfd_create, abstract Unix sockets)"),
    "ucx": ("pdflow.transports.ucx:UcxTransport", "pip install 'pdflow[ucx]'"),
    "verbs": (
        "pdflow.transports.verbs:VerbsTransport",
        "needs an RDMA device and pyverbs: apt-get install python3-pyverbs "
        "(a virtualenv sees it only with --system-site-packages)",
    ),
}
ROUTERS = {
    "round_robin": ("pdflow.routing.policies:RoundRobinRouter", ""),
    "least_loaded": ("pdflow.routing.policies:LeastLoadedRouter", ""),
    "power_of_two": ("pdflow.routing.policies:PowerOfTwoRouter", ""),
    "cache_aware": ("pdflow.routing.policies:CacheAwareRouter", ""),
}
PROPOSERS = {
    "ngram": ("pdflow.speculative.ngram:NgramProposer", ""),
    "self-draft": ("pdflow.speculative.self_draft:SelfDraftProposer", ""),
}
KV_CODECS = {
    "none": ("pdflow.kv.codecs.lossless:NoCodec", ""),
    "int8": ("pdflow.kv.codecs.quantized:Int8", ""),
    "int4": ("pdflow.kv.codecs.quantized:Int4", ""),
    "head-prune": ("pdflow.kv.codecs.structural:HeadPrune", ""),
    "sink-window": ("pdflow.kv.codecs.structural:SinkWindow", ""),
}
WEIGHT_FORMATS = {
    "fp32": ("pdflow.engine.weights.formats:Fp32", ""),
    "bf16": ("pdflow.engine.weights.formats:Bf16", ""),
    "int8": ("pdflow.engine.weights.formats:Int8", ""),
    "int4": ("pdflow.engine.weights.formats:Int4", ""),
    "int8-a16": ("pdflow.engine.weights.formats:Int8A16", ""),
    "int4-a16": ("pdflow.engine.weights.formats:Int4A16", ""),
    "int8-a8": ("pdflow.engine.weights.formats:Int8A8", ""),
    "int4-a8": ("pdflow.engine.weights.formats:Int4A8", ""),
    "int4-a16-blocked": ("pdflow.engine.weights.formats:Int4A16Blocked", ""),
}
DEFAULT_WEIGHTS = "int4-a16-blocked"  # the fastest format whose greedy answers agree with fp32's >= 99% (docs/benchmarks.md)

stage_kinds = Registry("stage kind", "pdflow.stages", "pdflow.runtime.stage:Stage", STAGE_KINDS)
transports = Registry("transport", "pdflow.transports", "pdflow.transports.base:Transport", TRANSPORTS)
routers = Registry("router", "pdflow.routers", "pdflow.routing.base:Router", ROUTERS)
proposers = Registry("proposer", "pdflow.proposers", "pdflow.speculative.base:Proposer", PROPOSERS)
kv_codecs = Registry("KV codec", "pdflow.kv_codecs", "pdflow.kv.codecs.base:KvCodec", KV_CODECS)
weight_formats = Registry("weight format", "pdflow.weights", "pdflow.engine.weights.base:WeightFormat", WEIGHT_FORMATS)

# What the built-in stage kinds' classes say of KV (``Stage.computes_kv``, ``Stage.holds_kv``),
# known without importing them: prefill's imports the engine and torch, 2 s of CPU in a launcher
# whose checks ask (tests/test_pipeline_api.py checks each against its class).
BUILTIN_KV_TRAITS = {"computes_kv": frozenset({"prefill"}), "holds_kv": frozenset({"kv_shuttle", "worker"})}


def stage_kind_kv_trait(kind, trait: str) -> bool:
    """Whether stage kind ``kind`` (a name or a class spec) says ``trait`` ("computes_kv" or
    "holds_kv"): a built-in kind's from :data:`BUILTIN_KV_TRAITS`, any other's from its class."""
    if isinstance(kind, str) and kind in stage_kinds.builtin:
        return kind in BUILTIN_KV_TRAITS[trait]
    return bool(getattr(stage_kinds.load(kind), trait, False))
