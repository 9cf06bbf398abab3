"""The pipeline as data: which model, which stages (by kind) with how many replicas where, how
their outputs connect, the KV links between them, and the router.

A :class:`Pipeline` is what ``topology.toml`` decodes into (:mod:`pdflow.config.topology`) and
what code builds::

    pipeline = (Pipeline.default()
                .with_egress()  # detokenize in a stage of its own (by default ingress does)
                .with_stage("redact", "mypkg.redact:RedactStage", after="egress", output="text",
                            options={"words": ["secret"]})
                .with_router("least_loaded"))
    check_pipeline(pipeline)  # PipelineError("stages.redact.kind: ...") when something does not fit

(:func:`pdflow.config.checks.check_pipeline`: the checks are the caller's to run; the launcher
runs them before it starts a process.)

It is frozen and picklable: the launcher hands it as is to every stage process.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdflow.plugins import DEFAULT_WEIGHTS, stage_kinds

STAGE_NAMES = ("ingress", "prefill", "kv_shuttle", "decode")  # mode "disaggregated"
COLOCATED_STAGE_NAMES = ("ingress", "worker")  # mode "colocated"
MODES = {"disaggregated": STAGE_NAMES, "colocated": COLOCATED_STAGE_NAMES}
OPTIONAL_STAGE_NAMES = ("egress",)  # built in, but in a pipeline only when asked for (either mode)
# the stages whose output "tokens" carries the generated tokens (to ingress, or to an egress stage)
TOKEN_PRODUCERS = {"disaggregated": ("prefill", "decode"), "colocated": ("worker",)}
KV_STREAMING = ("layer", "request")
DTYPES = ("float32", "bfloat16", "float16")
# the disaggregated mode's links: the prompt's KV, a cached prefix to prefill, answers back to the store
LINK_PAIRS = (("prefill", "kv_shuttle"), ("kv_shuttle", "decode"), ("kv_shuttle", "prefill"), ("decode", "kv_shuttle"))
DEFAULT_PORTS = {
    "ingress": 5510, "prefill": 5520, "kv_shuttle": 5530, "decode": 5540, "egress": 5550, "worker": 5560,
}
PLUGIN_PORTS = 5570  # stages of other kinds without a port: 5570, 5580, ... in pipeline order
DEFAULT_DATA_PORTS = {"prefill": 5620, "kv_shuttle": 5630, "decode": 5640}  # only the stages that receive KV
# where a mode rewires built-in outputs (a matched stop string stops the stage that decodes)
MODE_OUTPUTS = {"colocated": {"egress": {"stop": "worker"}, "ingress": {"stop": "worker"}}}
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class PipelineError(ValueError):
    """A pipeline that cannot run: ``key`` is the dotted key at fault (``stages.redact.outputs``)."""

    def __init__(self, key: str, message: str):
        super().__init__(key, message)
        self.key, self.message = key, message

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``dtype``: activations and KV; ``weights``: how linear layers' weights are stored and
    multiplied (a weight format: ``fp32``, ``bf16``, ``int8``, ``int4`` or a plug-in)."""

    source: str = "smollm2"
    dtype: str = "float32"
    served_name: str = "smollm2"  # resolved: never ""
    is_path: bool = False
    path: Path | None = None  # absolute, when is_path
    weights: str = DEFAULT_WEIGHTS
    max_model_len: int | None = None  # tokens of context served, at most the model's own (None: the model's)

    def context(self, model_context: int) -> int:
        """The context served of a model whose own is ``model_context`` tokens."""
        return min(model_context, self.max_model_len or model_context)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP API. ``max_body_bytes``: a larger request body is refused (413) before it is
    read; ``header_timeout_s``: a connection that has not sent a request's headers by then is
    closed; ``max_messages``: a chat request with more messages is refused (400) before it is
    templated; ``metrics_open``: ``GET /metrics`` is served without the API key (the rest keeps it).
    With several ingress replicas each serves the API on a port of its own, ``port + i``, or, with
    ``reuse_port``, all on ``port`` (SO_REUSEPORT: the kernel spreads connections among those on one
    host)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 2**20
    header_timeout_s: float = 10.0
    max_messages: int = 4096
    metrics_open: bool = False
    reuse_port: bool = False

    def port_of(self, replica: int) -> int:
        """The HTTP port of ingress replica ``replica``."""
        return self.port if self.reuse_port else self.port + replica


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Who may speak to the pipeline.

    ``secret_file`` / ``secret_env``: where the pipeline secret is (hex, as ``pdflow keys new``
    writes it); the launchers of every host must read the same one. Neither: a fresh secret for
    each run, which no other process can learn. ``api_key_file`` / ``api_key_env``: the key HTTP
    clients must send (``Authorization: Bearer <key>``); neither, and no ``pdflow run
    --api-key``: the API is open. ``authenticate = false`` turns the control plane's CURVE and
    the data plane's proof off (to measure what they cost; never on a shared machine).
    """

    secret_file: Path | None = None
    secret_env: str = ""
    api_key_file: Path | None = None
    api_key_env: str = ""
    authenticate: bool = True


@dataclass(frozen=True, slots=True)
class HostConfig:
    """A machine of a pipeline that spans several (the topology's ``[hosts.NAME]``): ``address``
    is where the other machines reach it (what its stages advertise), ``bind`` what its sockets
    bind to (e.g. ``0.0.0.0``; "" = ``address``)."""

    name: str
    address: str
    bind: str = ""

    @property
    def bind_host(self) -> str:
        return self.bind or self.address


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The launcher's endpoints: stages push to a PULL on ``port`` and listen to a PUB on ``port + 1``.

    ``host``: where stages reach them; ``bind``: what they bind to ("" = ``host``); ``on``: the
    host (of the topology's ``[hosts]``) whose launcher supervises the pipeline ("" = this
    machine, in a one-host pipeline)."""

    host: str = "127.0.0.1"
    port: int = 5500
    bind: str = ""
    on: str = ""

    @property
    def pull_address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pub_address(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    @property
    def pull_bind_address(self) -> str:
        return f"tcp://{self.bind or self.host}:{self.port}"

    @property
    def pub_bind_address(self) -> str:
        return f"tcp://{self.bind or self.host}:{self.port + 1}"


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int = 32
    max_queued_requests: int = 256
    request_timeout_s: float = 300.0
    ready_timeout_s: float = 180.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    shutdown_grace_s: float = 5.0
    max_restarts: int = 5
    max_migrations: int = 2  # a request whose replica dies is resubmitted on live ones this many times


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How prefill and decode are arranged.

    ``mode``: "disaggregated" (prefill, kv-shuttle and decode processes) or "colocated" (one
    worker process does both: the baseline disaggregation is compared with).
    ``kv_streaming``: "layer" sends each layer's KV the moment it is computed; "request" sends
    it all after the prefill (the naive design, for comparison).
    ``chunked_prefill_tokens``: colocated only; 0 prefills whole prompts, N interleaves prefill
    chunks of N tokens with decode steps.
    """

    mode: str = "disaggregated"
    kv_streaming: str = "layer"
    chunked_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvConfig:
    """The KV store (in kv-shuttle; the colocated worker keeps its own).

    ``prefix_cache``: reuse the KV of prompt prefixes seen before (and of earlier answers).
    ``block_tokens``: tokens per block, the unit of reuse, eviction and transfer bookkeeping.
    ``store_bytes``: the store's arena, allocated once (pages are mapped as they fill).
    ``high_watermark`` / ``low_watermark``: above this fraction of blocks in use, evict least
    recently used blocks down to that one.
    ``decode_pool_bytes``: decode's own KV pool, in the same blocks (pages mapped as they fill),
    where the KV of the requests it decodes lands and stays; each request holds the blocks of its
    prompt and ``max_tokens`` from its arrival to its end, and waits while they are not free.
    ``zero_copy``: where prefill and decode share memory with kv-shuttle (``shm`` links, one
    kv-shuttle replica, decode attending with pdflow's kernel), prefill computes each layer's KV
    straight into the store's blocks and decode attends from them (its pool is then the store);
    false keeps the copies, to compare.
    ``disk_path``: the store's disk tier, a directory (none: memory only); each kv-shuttle
    replica keeps its blocks in its own subdirectory. ``disk_capacity``: at most this much on
    disk (least recently used segments go first). ``disk_segment_bytes``: the size of one
    segment file (the unit of disk eviction).
    ``block_ttl_s``: how long a stored block is kept (``inf``: until evicted); a request may
    ask for less (``kv_ttl_s`` in its body; 0 keeps none of its KV).
    ``prefetch``: read a queued request's prefix from disk as soon as it arrives (false: when
    prefill gets to it, to compare).
    ``codec`` / ``codec_options``: how the store keeps its blocks, in memory and on disk
    (:mod:`pdflow.kv.codecs`; "int8": 3.9x the blocks in the same memory); chunks into the store
    are encoded by their senders, chunks out of it decoded where they land.
    ``direct``: a request whose prefix the store does not hold has prefill write its KV straight
    into decode's pool, and into the store behind it, instead of through the store (which
    forwards nothing for it): one hop fewer on the way to decode.
    """

    prefix_cache: bool = True
    block_tokens: int = 64
    store_bytes: int = 4 << 30
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    decode_pool_bytes: int = 4 << 30
    zero_copy: bool = True
    disk_path: Path | None = None
    disk_capacity: int = 64 << 30
    disk_segment_bytes: int = 256 << 20
    block_ttl_s: float = float("inf")
    prefetch: bool = True
    codec: str = "none"
    codec_options: dict[str, Any] = field(default_factory=dict)
    direct: bool = False

    def store_codec(self):
        """The store's codec, or None where it keeps the KV's own bytes (errors as LinkConfig.make_codec)."""
        from pdflow.kv.codecs import codec

        made = codec(self.codec, **self.codec_options)
        return None if made.lossless and not made.structural else made


LOCALITIES = ("host", "none")  # router.locality


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How ingress picks each stage's replica: a policy name (``round_robin``, ``least_loaded``,
    ``power_of_two``, an entry point of ``pdflow.routers``, ``"module:Class"``) or a Router class.
    ``locality``: ``"host"`` keeps a request's prefill and the store it writes into on one host
    across machines (:mod:`pdflow.routing.locality`); ``"none"`` picks each on its own."""

    policy: str | type = "round_robin"
    options: dict[str, Any] = field(default_factory=dict)
    locality: str = "host"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding in decode (and the colocated worker): ``method`` names a proposer
    (``"none"``: off; ``"ngram"``; an entry point of ``pdflow.proposers``; ``"module:Class"``),
    ``options`` its parameters; the rest as :class:`pdflow.speculative.Speculation` takes them
(:func:`pdflow.speculative.speculation_for` builds it, in the stage that decodes)."""

    method: str = "none"
    num_tokens: int = 5
    adaptive: bool = True
    max_rows: int = 64
    row_cost: float = 0.25  # pdflow.speculative.speculation.ROW_COST
    probe_every: int = 8
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True, slots=True)
class ScalerConfig:
    """The adaptive scaler (:mod:`pdflow.runtime.scaler`): every ``interval_s`` it weighs each
    scaled stage's load (stages with ``min_replicas`` below ``replicas``) against the SLOs and
    starts or drains one replica. A stage is *hot* when its latency p90 over the last
    ``window_s`` is past its SLO (prefill: TTFT; decode: TBT) or its work per running replica
    (prefill: requests held; decode: sequences in its batch) is past ``*_queue_per_replica``;
    *cold* when its latency is under half the SLO and one replica fewer would stay under half
    that bound. Hot for ``up_after_s``: one more; cold for ``down_after_s``: one fewer (drained
    first); then, for ``cooldown_s``, that stage neither changes nor gathers evidence (the load a
    new replica takes off shows only later)."""

    interval_s: float = 1.0
    window_s: float = 10.0
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 200.0
    prefill_queue_per_replica: float = 2.0
    decode_queue_per_replica: float = 16.0
    up_after_s: float = 3.0
    down_after_s: float = 15.0
    cooldown_s: float = 10.0


@dataclass(frozen=True, slots=True)
class StageConfig:
    """One stage; replica ``i`` listens on ``port + i`` (and receives KV on ``data_port + i``).

    ``kind``: which Stage class runs it (a registry name, ``"module:Class"`` or the class; "" =
    the stage's name). ``outputs``: rewires the kind's named outputs to other stages, e.g.
    ``{"text": "redact"}``. ``options``: settings for the kind (plug-in stages read them).
    """

    name: str
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    data_port: int | None = None
    cores: tuple[int, ...] = ()
    device: str = "cpu"
    kind: str | type = ""
    outputs: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    placement: tuple[HostConfig, ...] = ()  # the host of each replica (or one for all); () = ``host``
    min_replicas: int | None = None  # below ``replicas``: the scaler runs between the two (None: all run)

    @property
    def scaled(self) -> bool:
        return self.min_replicas is not None and self.min_replicas < self.replicas

    @property
    def floor(self) -> int:
        """Replicas that always run (the rest only when the scaler starts them)."""
        return self.min_replicas if self.scaled else self.replicas

    @property
    def kind_name(self) -> str | type:
        return self.kind or self.name

    def host_of(self, replica: int) -> HostConfig | None:
        """The machine replica ``replica`` runs on (None: a one-host pipeline's, at ``host``)."""
        if not self.placement:
            return None
        return self.placement[replica if len(self.placement) > 1 else 0]

    def address_of(self, replica: int) -> str:
        """Where peers reach replica ``replica`` (its control and data endpoints)."""
        placed = self.host_of(replica)
        return self.host if placed is None else placed.address

    def bind_host_of(self, replica: int) -> str:
        """What replica ``replica``'s sockets bind to."""
        placed = self.host_of(replica)
        return self.host if placed is None else placed.bind_host

    def control_address(self, replica: int) -> str:
        return f"tcp://{self.address_of(replica)}:{self.port + replica}"

    def control_bind_address(self, replica: int) -> str:
        return f"tcp://{self.bind_host_of(replica)}:{self.port + replica}"

    def data_port_of(self, replica: int) -> int:
        if self.data_port is None:
            raise ValueError(f"stage {self.name} receives no KV data, so it has no data port")
        return self.data_port + replica

    @property
    def display_name(self) -> str:
        return self.name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """One data-plane link. ``codec``: how KV is encoded on it (:mod:`pdflow.kv.codecs`; "none":
    as it is), with ``codec_options`` its parameters."""

    src: str
    dst: str
    transport: str = "tcp"
    options: dict[str, Any] = field(default_factory=dict)
    codec: str = "none"
    codec_options: dict[str, Any] = field(default_factory=dict)

    def make_codec(self):
        """The link's codec (LookupError / ImportError / TypeError / ValueError if it cannot be)."""
        from pdflow.kv.codecs import codec

        return codec(self.codec, **self.codec_options)


@dataclass(frozen=True, slots=True)
class Pipeline:
    model: ModelConfig = ModelConfig()
    server: ServerConfig = ServerConfig()
    control: ControlConfig = ControlConfig()
    limits: Limits = Limits()
    stages: dict[str, StageConfig] = field(default_factory=dict)  # in pipeline order, ingress first
    links: tuple[LinkConfig, ...] = ()
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = RouterConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    scaler: ScalerConfig = ScalerConfig()
    kv: KvConfig = KvConfig()
    security: SecurityConfig = SecurityConfig()
    hosts: dict[str, HostConfig] = field(default_factory=dict)  # several machines: by name; {} = one
    path: Path | None = None  # the topology file it came from (absolute), if any

    # --- building in code ----------------------------------------------------------------------

    @classmethod
    def default(cls, mode: str = "disaggregated", model: str | ModelConfig = "smollm2", **fields: Any) -> Pipeline:
        """The built-in pipeline of ``mode`` with default ports, links and limits."""
        if mode not in MODES:
            raise PipelineError("engine.mode", f"expected one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(model, str):
            model = ModelConfig(source=model, served_name=model)
        stages = {name: default_stage(name, mode) for name in MODES[mode]}
        links = tuple(LinkConfig(*pair) for pair in LINK_PAIRS) if mode == "disaggregated" else ()
        engine = fields.pop("engine", EngineConfig(mode=mode))
        return cls(model=model, stages=stages, links=links, engine=engine, **fields)

    def with_stage(
        self, name: str, kind: str | type, *, after: str | None = None, output: str = "text",
        **config: Any,
    ) -> Pipeline:
        """Add stage ``name`` of ``kind``. With ``after``: splice it into ``after``'s ``output``
        (what went from ``after`` to X now goes ``after`` -> ``name`` -> X); ``config`` sets the
        other StageConfig fields (replicas, port, options, ...)."""
        if name in self.stages:
            raise PipelineError(f"stages.{name}", f"there is already a stage named {name!r}")
        stages = dict(self.stages)
        outputs = dict(config.pop("outputs", {}))
        if after is not None:
            if after not in stages:
                raise PipelineError(f"stages.{name}", f"cannot insert after {after!r}: no such stage")
            upstream = stages[after]
            target = upstream.outputs.get(output) or _default_output(upstream, output)
            outputs.setdefault(output, target)
            stages[after] = dataclasses.replace(upstream, outputs={**upstream.outputs, output: name})
        port = config.pop("port", 0) or free_plugin_port(stages)
        stages[name] = StageConfig(name=name, kind=kind, port=port, outputs=outputs, **config)
        return dataclasses.replace(self, stages=stages)

    def with_egress(self, **config: Any) -> Pipeline:
        """Detokenize in an egress stage of its own instead of in ingress: the tokens of prefill
        and decode (or the worker) go to it, and its text to ingress. ``config`` sets the other
        StageConfig fields (replicas, cores, ...)."""
        if "egress" in self.stages:
            raise PipelineError("stages.egress", "there is already a stage named 'egress'")
        stages = {**self.stages, "egress": default_stage("egress", self.engine.mode, **config)}
        return dataclasses.replace(self, stages=route_tokens_through(stages, self.engine.mode, "egress"))

    def with_stage_config(self, name: str, **changes: Any) -> Pipeline:
        if name not in self.stages:
            raise PipelineError(f"stages.{name}", f"no stage named {name!r}")
        stages = {**self.stages, name: dataclasses.replace(self.stages[name], **changes)}
        return dataclasses.replace(self, stages=stages)

    def with_kv(self, **changes: Any) -> Pipeline:
        """The KV store's settings changed, e.g. ``with_kv(prefix_cache=False)``."""
        return dataclasses.replace(self, kv=dataclasses.replace(self.kv, **changes))

    def with_security(self, **changes: Any) -> Pipeline:
        """Who may speak to it changed, e.g. ``with_security(api_key_env="MY_KEY")``."""
        return dataclasses.replace(self, security=dataclasses.replace(self.security, **changes))

    def with_router(self, policy: str | type, *, locality: str | None = None, **options: Any) -> Pipeline:
        return dataclasses.replace(self, router=RouterConfig(policy, options, locality or self.router.locality))

    def with_transport(self, transport: str, **options: Any) -> Pipeline:
        """Every KV link over ``transport`` (``"inproc"`` for a pipeline inside one process)."""
        links = tuple(dataclasses.replace(link, transport=transport, options=options) for link in self.links)
        return dataclasses.replace(self, links=links)

    def with_ports(self, base: int) -> Pipeline:
        """Every port from ``base`` up: the server, the launcher's two, then each stage's."""
        port = base + 3
        stages = {}
        for name, stage in self.stages.items():
            changes: dict[str, Any] = {"port": port}
            port += stage.replicas
            if stage.data_port is not None:
                changes["data_port"] = port
                port += stage.replicas
            stages[name] = dataclasses.replace(stage, **changes)
        return dataclasses.replace(self, server=dataclasses.replace(self.server, port=base),
                                   control=dataclasses.replace(self.control, port=base + 1), stages=stages)

    # --- reading ---------------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        return self.engine.mode == "colocated"

    def link(self, src: str, dst: str) -> LinkConfig:
        for link in self.links:
            if (link.src, link.dst) == (src, dst):
                return link
        raise KeyError(f"no data-plane link {src} -> {dst}")

    def replicas(self, host: str | None = None) -> list[tuple[str, int]]:
        """Every ``(stage, replica)`` to start, stage by stage in pipeline order (on ``host``
        alone, a name of :attr:`hosts`, when given)."""
        return [(name, i) for name, stage in self.stages.items() for i in range(stage.replicas)
                if host is None or self.host_name_of(name, i) == host]

    def host_name_of(self, stage: str, replica: int) -> str:
        """The name of the host ``stage``'s replica ``replica`` runs on ("" in a one-host pipeline)."""
        placed = self.stages[stage].host_of(replica)
        return "" if placed is None else placed.name

    @property
    def multi_host(self) -> bool:
        """Whether its replicas run on more than one machine."""
        return len({self.host_name_of(*r) for r in self.replicas()} | {self.control.on}) > 1


def default_stage(name: str, mode: str = "disaggregated", **config: Any) -> StageConfig:
    """A built-in stage with its default ports (and outputs, in ``mode``)."""
    config.setdefault("port", DEFAULT_PORTS[name])
    if name in DEFAULT_DATA_PORTS:
        config.setdefault("data_port", DEFAULT_DATA_PORTS[name])
    config["outputs"] = {**default_outputs(name, mode), **config.get("outputs", {})}
    return StageConfig(name=name, **config)


def route_tokens_through(stages: dict[str, StageConfig], mode: str, name: str) -> dict[str, StageConfig]:
    """``stages`` with the token producers' output "tokens" going to stage ``name``, except where
    it was wired already."""
    stages = dict(stages)
    for producer in TOKEN_PRODUCERS[mode]:
        config = stages.get(producer)
        if config is not None and "tokens" not in config.outputs:
            stages[producer] = dataclasses.replace(config, outputs={**config.outputs, "tokens": name})
    return stages


def default_outputs(name: str, mode: str) -> dict[str, str]:
    """The outputs ``mode`` gives built-in stage ``name`` (beyond its kind's own)."""
    return dict(MODE_OUTPUTS.get(mode, {}).get(name, {}))


def _default_output(stage: StageConfig, output: str) -> str:
    outputs = stage_kinds.load(stage.kind_name).outputs
    if output not in outputs:
        raise PipelineError(f"stages.{stage.name}.outputs", f"a {stage.kind_name} stage has no output {output!r}; "
                            f"its outputs: {', '.join(outputs) or 'none'}")
    return outputs[output]


def free_plugin_port(stages: dict[str, StageConfig]) -> int:
    taken = {s.port + i for s in stages.values() for i in range(s.replicas)}
    port = PLUGIN_PORTS
    while port in taken:
        port += 10
    return port
