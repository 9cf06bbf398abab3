"""Checks on a whole pipeline, however it was built: stage kinds and their outputs, replicas,
ports that clash, links and their transports, the router.

Each failure is a :class:`~pdflow.config.pipeline.PipelineError` naming the dotted key at fault;
:mod:`pdflow.config.topology` adds the file and line when the pipeline came from TOML. Built-in
stage kinds wired as the pipeline itself wires them (its mode's outputs, and the token producers'
tokens to an egress stage) are not imported here (that would pull in torch for ``pdflow validate``);
plug-in kinds, and any stage whose outputs are rewired otherwise, are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdflow.config.pipeline import (
    DEFAULT_PORTS,
    DEVICE,
    LINK_PAIRS,
    MODES,
    Pipeline,
    PipelineError,
    TOKEN_PRODUCERS,
    StageConfig,
    default_outputs,
)
from pdflow import plugins
from pdflow.transports import shares_memory
from pdflow.config.toml_reader import describe
from pdflow.registry import spec_name

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})
_HOST_ALIASES = {"localhost": "127.0.0.1", "::1": "127.0.0.1", "[::1]": "127.0.0.1"}


def check_pipeline(pipeline: Pipeline, written: Callable[[str], bool] = lambda key: True,
                   cross_process: bool = True) -> None:
    """Raise PipelineError for the first thing that cannot run. ``written(key)`` says whether the
    user wrote a key (a port clash blames the one they wrote); ``cross_process``: stages will run
    as separate processes, so links need transports that cross them."""
    stages = pipeline.stages
    if "ingress" not in stages:
        raise PipelineError("stages.ingress", "every pipeline has an ingress stage (it serves the HTTP API)")
    for name in MODES[pipeline.engine.mode]:
        if name not in stages:
            raise PipelineError(f"stages.{name}", f"a {pipeline.engine.mode} pipeline needs a {name} stage")
    for name, stage in stages.items():
        _check_stage(pipeline, name, stage)
        if stage.kind_name == "egress" and not any(name in s.outputs.values() for s in stages.values()):
            producers = " and ".join(f"stages.{p}" for p in TOKEN_PRODUCERS[pipeline.engine.mode])
            raise PipelineError(f"stages.{name}", f"stage {name!r} detokenizes, but no stage sends it tokens "
                                f"(by default ingress detokenizes them itself); wire outputs.tokens = {name!r} "
                                f"on {producers}, or remove the stage")
    _check_links(pipeline, cross_process)
    _check_hosts(pipeline)
    _check_store_codec(pipeline)
    _check_direct(pipeline)
    _check_router(pipeline)
    _check_speculative(pipeline)
    _check_weights(pipeline)
    check_ports(pipeline, written)


SCALABLE_KINDS = ("prefill", "decode")  # they keep no KV past a request: a drained one loses nothing


def _check_scaled(pipeline: Pipeline, key: str, stage: StageConfig) -> None:
    if not 1 <= stage.min_replicas <= stage.replicas:
        raise PipelineError(f"{key}.min_replicas", f"expected an integer from 1 to replicas ({stage.replicas}), "
                            f"got {stage.min_replicas}")
    if stage.scaled and stage.kind_name not in SCALABLE_KINDS:
        raise PipelineError(f"{key}.min_replicas", f"the scaler starts and stops {' and '.join(SCALABLE_KINDS)} "
                            f"replicas only (the others keep state or own a port); remove min_replicas")


def _check_stage(pipeline: Pipeline, name: str, stage: StageConfig) -> None:
    key = f"stages.{name}"
    if stage.replicas < 1:
        raise PipelineError(f"{key}.replicas", f"expected an integer >= 1, got {stage.replicas}")
    if stage.min_replicas is not None:
        _check_scaled(pipeline, key, stage)
    if not DEVICE.fullmatch(stage.device):
        raise PipelineError(f"{key}.device", f'expected "cpu", "cuda" or "cuda:N", got {describe(stage.device)}')
    registry = plugins.stage_kinds
    builtin = isinstance(stage.kind_name, str) and stage.kind_name in registry.builtin
    if builtin and stage.outputs == _own_wiring(pipeline, name):
        return  # wired as the pipeline wires it
    if problem := registry.availability(stage.kind_name):
        what = "kind" if stage.kind else "name (no kind given, so the name is taken as the kind)"
        raise PipelineError(f"{key}.kind", f"stage {name!r}: its {what}: {problem}")
    cls = registry.load(stage.kind_name)
    for output, target in stage.outputs.items():
        if output not in cls.outputs:
            raise PipelineError(f"{key}.outputs.{output}", f"a {spec_name(stage.kind_name)} stage has no output "
                                f"{output!r}; its outputs: {', '.join(cls.outputs) or 'none'}")
    for output in cls.outputs:
        target = stage.outputs.get(output) or cls.outputs[output]
        if target not in pipeline.stages:
            raise PipelineError(f"{key}.outputs.{output}", f"output {output!r} goes to {target!r}, which is not "
                                f"a stage of this pipeline (stages: {', '.join(pipeline.stages)})")
    if stage.data_port is not None and not cls.receives_kv:
        raise PipelineError(f"{key}.data_port", f"a {spec_name(stage.kind_name)} stage receives no KV data; "
                            "remove data_port")


def _own_wiring(pipeline: Pipeline, name: str) -> dict[str, str]:
    """The outputs the pipeline itself gives built-in stage ``name``: its mode's, and "tokens" to
    an egress stage where the pipeline has one and ``name`` produces tokens (as
    :func:`~pdflow.config.pipeline.route_tokens_through` wires them)."""
    outputs = default_outputs(name, pipeline.engine.mode)
    producer = name in TOKEN_PRODUCERS[pipeline.engine.mode] and pipeline.stages[name].kind_name == name
    if producer and "egress" in pipeline.stages:
        outputs["tokens"] = "egress"
    return outputs


def _check_links(pipeline: Pipeline, cross_process: bool) -> None:
    seen: set[tuple[str, str]] = set()
    receiving: dict[str, dict[str, int]] = {}  # stage -> {transport: the first link into it over it}
    for i, link in enumerate(pipeline.links):
        key = f"links[{i}]"
        for end in (link.src, link.dst):
            if end not in pipeline.stages:
                raise PipelineError(key, f"link {link.src} -> {link.dst}: there is no stage {end!r}")
        builtin = {link.src, link.dst} <= set(DEFAULT_PORTS) and not (pipeline.stages[link.src].kind
                                                                     or pipeline.stages[link.dst].kind)
        if builtin and (link.src, link.dst) not in LINK_PAIRS:
            pairs = " or ".join(f"{s} -> {d}" for s, d in LINK_PAIRS)
            raise PipelineError(key, f"no data-plane link {link.src} -> {link.dst}; expected {pairs}")
        if pipeline.stages[link.dst].data_port is None:
            raise PipelineError(key, f"link {link.src} -> {link.dst}: {link.dst} has no data port to receive KV on")
        if (link.src, link.dst) in seen:
            raise PipelineError(key, f"link {link.src} -> {link.dst} is defined twice")
        seen.add((link.src, link.dst))
        into = receiving.setdefault(link.dst, {})
        into.setdefault(link.transport, i)
        if len(into) > 1 and not _one_shares_memory(list(into)):
            first, transport = next((at, name) for name, at in into.items() if name != link.transport)
            raise PipelineError(f"{key}.transport", f"{link.dst} receives KV on one data port, over {transport!r} "
                                f"(links[{first}]); link {link.src} -> {link.dst} must use it too, not "
                                f"{link.transport!r} (a stage may also receive over shm beside one network "
                                "transport: shm for stages on its host, the other for the rest)")
        if problem := transport_problem(link.transport, cross_process):
            raise PipelineError(f"{key}.transport", f"transport {link.transport!r} is not available: {problem}")
        from pdflow.transports.shaping import check_link_options

        if problem := check_link_options(dict(link.options)):
            raise PipelineError(f"{key}.options", problem)
        _check_codec(pipeline, link, key)


def _one_shares_memory(names: list[str]) -> bool:
    """Two transports, exactly one of which moves KV through shared memory (so they can share a
    data port: shm's socket is a Unix one)."""
    return len(names) == 2 and sum(shares_memory(name) for name in names) == 1


def _paired_on_every_host(pipeline: Pipeline, link) -> bool:
    """Is ``link`` one between a stage that computes prompts' KV and the store it writes into,
    which ingress keeps on one host (router.locality), with a replica of each on the same hosts?"""
    if pipeline.router.locality != "host":
        return False
    kinds = {end: pipeline.stages[end].kind_name for end in (link.src, link.dst)}
    producer = next((end for end, kind in kinds.items() if plugins.stage_kind_kv_trait(kind, "computes_kv")), None)
    store = next((end for end, kind in kinds.items() if plugins.stage_kind_kv_trait(kind, "holds_kv")), None)
    if producer is None or store is None or producer == store:
        return False
    hosts = [{pipeline.host_name_of(end, r) for r in range(pipeline.stages[end].replicas)} for end in (producer, store)]
    return hosts[0] == hosts[1]


def _check_hosts(pipeline: Pipeline) -> None:
    """Placements that name the pipeline's hosts; across machines, authenticated planes and a
    secret every host can read, and no link over a transport that stays on one machine."""
    hosts = pipeline.hosts
    if pipeline.control.on and pipeline.control.on not in hosts:
        raise PipelineError("control.on", f"no host named {pipeline.control.on!r}; the hosts are "
                            f"{', '.join(hosts) or 'none'}")
    for name, stage in pipeline.stages.items():
        key = f"stages.{name}.on"
        if hosts and not stage.placement:
            raise PipelineError(key, f"the pipeline names its hosts ({', '.join(hosts)}); place stage {name!r} on one")
        if len(stage.placement) not in (0, 1, stage.replicas):
            raise PipelineError(key, f"expected one host for every replica or one per replica ({stage.replicas}), "
                                f"got {len(stage.placement)}")
        for placed in stage.placement:
            if hosts.get(placed.name) != placed:
                raise PipelineError(key, f"host {placed.name!r} is not one of the pipeline's hosts "
                                    f"({', '.join(hosts) or 'none'})")
    if not pipeline.multi_host:
        return
    security = pipeline.security
    if not security.authenticate:
        raise PipelineError("security.authenticate", "the pipeline spans several hosts: its control and data "
                            "planes cross the network, and pdflow refuses that unauthenticated; remove "
                            "authenticate = false")
    if security.secret_file is None and not security.secret_env:
        raise PipelineError("security", "the pipeline spans several hosts, whose launchers must share one secret: "
                            'set secret_file = "pipeline.key" (from `pdflow keys new pipeline.key`, copied to every '
                            'host) or secret_env = "NAME" in [security]')
    for i, link in enumerate(pipeline.links):
        if not shares_memory(link.transport):
            continue
        ends = {pipeline.host_name_of(stage, r) for stage in (link.src, link.dst)
                for r in range(pipeline.stages[stage].replicas)}
        # (a store beside each prefill host: ingress pairs the two, the link stays on each host)
        if len(ends) > 1 and not _paired_on_every_host(pipeline, link):
            raise PipelineError(f"links[{i}].transport", f"transport {link.transport!r} shares memory on one "
                                f"machine, but {link.src} and {link.dst} run on hosts {', '.join(sorted(ends))}; "
                                "use tcp (or ucx, verbs) between hosts, or run a kv_shuttle beside each prefill "
                                "host (on the same hosts as prefill), which ingress pairs")


def _check_direct(pipeline: Pipeline) -> None:
    """kv.direct: prefill writes into decode's pool over the store's link to decode."""
    if not pipeline.kv.direct:
        return
    if pipeline.colocated:
        raise PipelineError("kv.direct", "the colocated worker keeps its KV itself: there is no store to go "
                            "around; remove direct")
    link = pipeline.link("kv_shuttle", "decode")
    if _made_codec(link.make_codec, "links").structural:
        raise PipelineError("kv.direct", f"the link into decode drops KV ({link.codec}), which only the store "
                            "knows how to lay out in decode's pool; remove direct or that codec")
    if pipeline.multi_host and shares_memory(link.transport):
        raise PipelineError("kv.direct", f"prefill writes into decode's pool over the link into decode, and "
                            f"{link.transport!r} does not cross hosts; use tcp (or ucx, verbs) there")


def _made_codec(make, key: str):
    """``make()`` (a codec from a table's ``codec`` and ``codec_options``), or PipelineError
    naming the key at fault (``key``: the table's)."""
    try:
        return make()
    except (LookupError, ImportError) as exc:
        raise PipelineError(f"{key}.codec", str(exc).strip("'\"")) from None
    except (TypeError, ValueError) as exc:
        raise PipelineError(f"{key}.codec_options", str(exc)) from None


def _check_store_codec(pipeline: Pipeline) -> None:
    store = _made_codec(pipeline.kv.store_codec, "kv")
    if store is not None and store.structural:
        raise PipelineError("kv.codec", f"codec {pipeline.kv.codec!r} drops KV (heads or tokens): prefill computes on "
                            "from a stored prefix and needs all of it; use it on the link into decode "
                            "(kv_shuttle -> decode), which is the only place it applies")
    if store is not None and pipeline.kv.zero_copy and not pipeline.colocated and \
            any(link.transport == "shm" for link in pipeline.links):
        raise PipelineError("kv.codec", f"the store's blocks in {pipeline.kv.codec!r} cannot be computed into by "
                            "prefill nor attended from by decode, which kv.zero_copy over shm links does; set "
                            "zero_copy = false")


def _check_codec(pipeline: Pipeline, link, key: str) -> None:
    codec = _made_codec(link.make_codec, key)
    if codec.structural:
        _check_structural_codec(pipeline, link, codec, key)
    if (not codec.lossless or codec.structural) and link.transport == "shm" and pipeline.kv.zero_copy:
        raise PipelineError(f"{key}.codec", f"with kv.zero_copy, an shm link moves no KV bytes, so codec "
                            f"{link.codec!r} would encode nothing; set zero_copy = false in [kv] to encode KV on "
                            "this link, or use the codec on a tcp or ucx link")


def _check_structural_codec(pipeline: Pipeline, link, codec, key: str) -> None:
    """A codec that drops KV (kv heads, prompt tokens) only on the link into decode, and decode
    attending from its pool of blocks (where it keeps the tokens' positions apart from their
    places)."""
    kinds = (pipeline.stages[link.src].kind_name, pipeline.stages[link.dst].kind_name)
    if kinds != ("kv_shuttle", "decode"):
        raise PipelineError(f"{key}.codec", f"codec {link.codec!r} drops KV (heads or tokens), which only decode can "
                            f"attend without; on {link.src} -> {link.dst} it would reach prefill or the store, which "
                            "need all of it. Use it on the link kv_shuttle -> decode")
    decode = pipeline.stages[link.dst]
    if codec.drops_tokens and (pipeline.model.dtype != "float32" or decode.device != "cpu"):
        raise PipelineError(f"{key}.codec", f"codec {link.codec!r} needs decode attending from its pool of blocks "
                            "with pdflow's kernels: model.dtype = \"float32\" and decode on the cpu, not "
                            f"{pipeline.model.dtype} on {decode.device}")


def _check_router(pipeline: Pipeline) -> None:
    if problem := plugins.routers.availability(pipeline.router.policy):
        raise PipelineError("router.policy", problem)


def _check_speculative(pipeline: Pipeline) -> None:
    """The proposer exists and takes its options (built without a model: a proposer's ``check``
    validates its parameters only)."""
    spec = pipeline.speculative
    if not spec.enabled:
        return
    if problem := plugins.proposers.availability(spec.method):
        raise PipelineError("speculative.method", problem)
    try:
        plugins.proposers.load(spec.method)(None, **spec.options)
    except (TypeError, ValueError) as exc:
        raise PipelineError("speculative.options", str(exc)) from None


def _check_weights(pipeline: Pipeline) -> None:
    if pipeline.model.weights in plugins.WEIGHT_FORMATS:
        return
    if problem := plugins.weight_formats.availability(pipeline.model.weights):
        raise PipelineError("model.weights", problem)


def known_models() -> frozenset[str]:
    from pdflow.models import KNOWN_MODELS

    return frozenset(KNOWN_MODELS)


def transport_problem(name: str, cross_process: bool = True) -> str | None:
    """None when transport ``name`` can link two stages here, else why not."""
    problem = plugins.transports.availability(name)
    if problem is None and cross_process and not plugins.transports.load(name).cross_process:
        problem = "it connects peers inside one process only (for tests); stages run as separate processes"
    return problem


@dataclass(frozen=True, slots=True)
class _Endpoint:
    host: str
    port: int
    key: str  # the key that sets it
    offset: int = 0  # port = value of key + offset
    label: str = ""  # what the offset means: "replica 2", "the PUB socket"
    machine: str = ""  # the pipeline's host it is on ("" in a one-host pipeline)

    def describe(self) -> str:
        return self.key if not self.offset else f"{self.key} + {self.offset} ({self.label})"

    def overlaps(self, other: _Endpoint) -> bool:
        if self.port != other.port or self.machine != other.machine:
            return False
        a, b = (_HOST_ALIASES.get(h, h) for h in (self.host, other.host))
        return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


def _endpoints(pipeline: Pipeline) -> list[_Endpoint]:
    server, control = pipeline.server, pipeline.control
    found, http_on = [], {}  # the HTTP ports: one per ingress replica (server.reuse_port: per host)
    for i in range(pipeline.stages["ingress"].replicas if "ingress" in pipeline.stages else 1):
        machine = pipeline.host_name_of("ingress", i) if "ingress" in pipeline.stages else ""
        if not (server.reuse_port and machine in http_on):
            http_on[machine] = i
            found.append(_Endpoint(server.host, server.port_of(i), "server.port", server.port_of(i) - server.port,
                                   f"ingress replica {i}", machine))
    found += [
        _Endpoint(control.bind or control.host, control.port, "control.port", machine=control.on),
        _Endpoint(control.bind or control.host, control.port + 1, "control.port", 1, "the PUB socket", control.on),
    ]
    for name, stage in pipeline.stages.items():
        bases = [("port", stage.port)] + ([("data_port", stage.data_port)] if stage.data_port else [])
        for field, base in bases:
            found += [
                _Endpoint(stage.bind_host_of(i), base + i, f"stages.{name}.{field}", i, f"replica {i}",
                          pipeline.host_name_of(name, i))
                for i in range(stage.replicas)
            ]
    return found


def check_ports(pipeline: Pipeline, written: Callable[[str], bool] = lambda key: True) -> None:
    """Every endpoint in range, and no two on the same host and port (0.0.0.0 is every host)."""
    seen: list[_Endpoint] = []
    for endpoint in _endpoints(pipeline):
        if not 1 <= endpoint.port <= 65535:
            raise PipelineError(endpoint.key, f"{endpoint.describe()} would be port {endpoint.port}; "
                                "ports must be in 1..65535 (lower the port or the replicas)")
        for other in seen:
            if endpoint.overlaps(other):
                raise _clash(endpoint, other, written)
        seen.append(endpoint)


def _clash(later: _Endpoint, earlier: _Endpoint, written: Callable[[str], bool]) -> PipelineError:
    """Blame the later endpoint, unless only the earlier one was written by the user."""
    blamed, other = later, earlier
    if not written(later.key) and written(earlier.key):
        blamed, other = earlier, later
    own = f" ({blamed.label}, {blamed.key} + {blamed.offset})" if blamed.offset else ""
    hosts = "" if blamed.host == other.host else f" ({blamed.host} and {other.host} overlap)"
    return PipelineError(blamed.key, f"port {blamed.port}{own} is also used by {other.describe()}{hosts}")
