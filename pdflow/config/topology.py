"""The deployment: which model, which stages on which hosts, ports and cores, and the data plane.

``load_topology("topology.toml")`` decodes the file into frozen dataclasses and checks everything
that can be checked before a process starts (types, ranges, port clashes, installed transports,
the model's directory), so a bad file fails at once with ``path:line: key: what is expected``
(:class:`TopologyError`) instead of as a hung or crashed stage later.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pdflow.config.toml_lines import LineMap
from pdflow.config.toml_reader import TableReader, TopologyError, describe, syntax_error
from pdflow.config.checks import check_ports, known_models, transport_problem

__all__ = [
    "STAGE_NAMES", "DTYPES", "ModelConfig", "ServerConfig", "ControlConfig", "Limits", "EngineConfig",
    "StageConfig", "LinkConfig", "Topology", "TopologyError", "load_topology", "parse_topology",
]

STAGE_NAMES = ("ingress", "prefill", "kv_shuttle", "decode", "egress")  # mode "disaggregated"
COLOCATED_STAGE_NAMES = ("ingress", "worker", "egress")  # mode "colocated"
ALL_STAGE_NAMES = ("ingress", "prefill", "kv_shuttle", "decode", "worker", "egress")
MODES = {"disaggregated": STAGE_NAMES, "colocated": COLOCATED_STAGE_NAMES}
KV_STREAMING = ("layer", "request")
DTYPES = ("float32", "bfloat16", "float16")
LINK_PAIRS = (("prefill", "kv_shuttle"), ("kv_shuttle", "decode"))
DEFAULT_PORTS = {
    "ingress": 5510, "prefill": 5520, "kv_shuttle": 5530, "decode": 5540, "egress": 5550, "worker": 5560,
}
DEFAULT_DATA_PORTS = {"kv_shuttle": 5630, "decode": 5640}  # only the stages that receive KV
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    source: str = "smollm2"
    dtype: str = "float32"
    served_name: str = "smollm2"  # resolved: never ""
    is_path: bool = False
    path: Path | None = None  # absolute, when is_path


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The launcher's endpoints: stages push to a PULL on ``port`` and listen to a PUB on ``port + 1``."""

    host: str = "127.0.0.1"
    port: int = 5500

    @property
    def pull_address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pub_address(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"


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
class StageConfig:
    """One stage; replica ``i`` listens on ``port + i`` (and receives KV on ``data_port + i``)."""

    name: str
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    data_port: int | None = None
    cores: tuple[int, ...] = ()
    device: str = "cpu"

    def control_address(self, replica: int) -> str:
        return f"tcp://{self.host}:{self.port + replica}"

    def data_port_of(self, replica: int) -> int:
        if self.data_port is None:
            raise ValueError(f"stage {self.name} receives no KV data, so it has no data port")
        return self.data_port + replica

    @property
    def display_name(self) -> str:
        return self.name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    src: str
    dst: str
    transport: str = "tcp"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Topology:
    path: Path  # absolute
    model: ModelConfig
    server: ServerConfig
    control: ControlConfig
    limits: Limits
    stages: dict[str, StageConfig]  # the mode's stages, in MODES[mode] order
    links: tuple[LinkConfig, ...]  # both, in LINK_PAIRS order (unused when colocated)
    engine: EngineConfig = EngineConfig()

    @property
    def colocated(self) -> bool:
        return self.engine.mode == "colocated"

    @property
    def decoder(self) -> str:
        """The stage that produces tokens after the first: decode, or the colocated worker."""
        return "worker" if self.colocated else "decode"

    def link(self, src: str, dst: str) -> LinkConfig:
        for link in self.links:
            if (link.src, link.dst) == (src, dst):
                return link
        raise KeyError(f"no data-plane link {src} -> {dst}")

    def replicas(self) -> list[tuple[str, int]]:
        """Every ``(stage, replica)`` to start, stage by stage in STAGE_NAMES order."""
        return [(name, i) for name, stage in self.stages.items() for i in range(stage.replicas)]


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise TopologyError(path, None, "(file)", f"cannot read the topology file: {reason}") from None
    return parse_topology(text, path)


def parse_topology(text: str, path: Path) -> Topology:
    """Decode and check topology ``text``; ``path`` is for messages and resolving relative paths."""
    path, lines = Path(path), LineMap(text)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise syntax_error(path, lines, e, text) from None
    r = TableReader(path, lines)
    r.check_keys(raw, "", ("model", "server", "control", "limits", "engine", "stages", "links"))
    engine = _engine(r, r.table(raw, "", "engine", ("mode", "kv_streaming", "chunked_prefill_tokens")))
    topology = Topology(
        path=path.absolute(),
        model=_model(r, r.table(raw, "", "model", ("source", "dtype", "served_name")), path),
        server=ServerConfig(**_endpoint(r, raw, "server", ServerConfig())),
        control=ControlConfig(**_endpoint(r, raw, "control", ControlConfig(), max_port=65534)),
        limits=_limits(r, r.table(raw, "", "limits", [f.name for f in fields(Limits)])),
        stages=_stages(r, r.table(raw, "", "stages", ALL_STAGE_NAMES), engine.mode),
        links=_links(r, raw.get("links", [])),
        engine=engine,
    )
    if topology.colocated and raw.get("links"):
        raise r.error("links", "a colocated topology has no data-plane links (its worker keeps the KV); "
                      "remove the [[links]] tables or set engine.mode = \"disaggregated\"")
    check_ports(r, topology)
    return topology


def _model(r: TableReader, t: dict[str, Any], topology_path: Path) -> ModelConfig:
    source = r.string(t, "model", "source", "smollm2", non_empty=True)
    dtype = r.string(t, "model", "dtype", "float32", choices=DTYPES)
    served_name = r.string(t, "model", "served_name", "")
    is_path = "/" in source or source.startswith((".", "~"))
    if not is_path:
        known = known_models()
        if source not in known:
            close = difflib.get_close_matches(source, list(known), n=1)
            hint = f"did you mean '{close[0]}'? Known models: " if close else "expected one of "
            raise r.error("model.source", f"unknown model '{source}'; {hint}{', '.join(sorted(known))}, "
                          "or a path to a local Hugging Face model directory (e.g. ./models/my-model)")
        return ModelConfig(source, dtype, served_name or source, False, None)
    path = (topology_path.absolute().parent / Path(source).expanduser()).resolve()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise r.error("model.source", f"model directory {path} {what}")
    if not (path / "config.json").is_file():
        raise r.error("model.source", f"{path} has no config.json; expected a Hugging Face model directory")
    return ModelConfig(source, dtype, served_name or path.name, True, path)


def _endpoint(r: TableReader, raw: dict[str, Any], name: str, default: Any, max_port: int = 65535) -> dict:
    t = r.table(raw, "", name, ("host", "port"))
    return {
        "host": r.string(t, name, "host", default.host, non_empty=True),
        "port": r.integer(t, name, "port", default.port, ge=1, le=max_port),
    }


def _limits(r: TableReader, t: dict[str, Any]) -> Limits:
    d = Limits()
    interval = r.number(t, "limits", "heartbeat_interval_s", d.heartbeat_interval_s, gt=0)
    return Limits(
        max_batch=r.integer(t, "limits", "max_batch", d.max_batch, ge=1),
        max_queued_requests=r.integer(t, "limits", "max_queued_requests", d.max_queued_requests, ge=1),
        request_timeout_s=r.number(t, "limits", "request_timeout_s", d.request_timeout_s, gt=0),
        ready_timeout_s=r.number(t, "limits", "ready_timeout_s", d.ready_timeout_s, gt=0),
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=_heartbeat_timeout(r, t, interval),
        shutdown_grace_s=r.number(t, "limits", "shutdown_grace_s", d.shutdown_grace_s, ge=0, lt=10),
        max_restarts=r.integer(t, "limits", "max_restarts", d.max_restarts, ge=0),
    )


def _heartbeat_timeout(r: TableReader, t: dict[str, Any], interval: float) -> float:
    timeout = r.number(t, "limits", "heartbeat_timeout_s", Limits().heartbeat_timeout_s, gt=0)
    if timeout <= interval:
        raise r.error("limits.heartbeat_timeout_s", f"expected a number > limits.heartbeat_interval_s "
                      f"({interval}) so that one late heartbeat is not a death, got {timeout}")
    return timeout


def _engine(r: TableReader, t: dict[str, Any]) -> EngineConfig:
    mode = r.string(t, "engine", "mode", "disaggregated", choices=tuple(MODES))
    streaming = r.string(t, "engine", "kv_streaming", "layer", choices=KV_STREAMING)
    chunk = r.integer(t, "engine", "chunked_prefill_tokens", 0, ge=0)
    if chunk and mode != "colocated":
        raise r.error("engine.chunked_prefill_tokens",
                      "chunked prefill is a colocated-worker setting; set engine.mode = \"colocated\" or 0")
    return EngineConfig(mode, streaming, chunk)


def _stages(r: TableReader, stages: dict[str, Any], mode: str) -> dict[str, StageConfig]:
    keys = ("replicas", "host", "port", "data_port", "cores", "device")
    wanted = MODES[mode]
    for name in stages:
        if name not in wanted:
            raise r.error(f"stages.{name}", f"a {mode} topology has no {name} stage; its stages are "
                          f"{', '.join(wanted)} (engine.mode picks the set)")
    return {name: _stage(r, name, r.table(stages, "stages", name, keys)) for name in wanted}


def _stage(r: TableReader, name: str, t: dict[str, Any]) -> StageConfig:
    prefix = f"stages.{name}"
    replicas = r.integer(t, prefix, "replicas", 1, ge=1)
    if name == "ingress" and replicas != 1:
        raise r.error(f"{prefix}.replicas",
                      f"ingress owns the HTTP port, so it must have exactly 1 replica, got {replicas}")
    if "data_port" in t and name not in DEFAULT_DATA_PORTS:
        raise r.error(f"{prefix}.data_port",
                      f"only kv_shuttle and decode receive KV data; remove data_port from [{prefix}]")
    device = r.string(t, prefix, "device", "cpu")
    if not _DEVICE.fullmatch(device):
        raise r.error(f"{prefix}.device", f'expected "cpu", "cuda" or "cuda:N", got {describe(device)}')
    return StageConfig(
        name=name,
        replicas=replicas,
        host=r.string(t, prefix, "host", "127.0.0.1", non_empty=True),
        port=r.integer(t, prefix, "port", DEFAULT_PORTS[name], ge=1, le=65535),
        data_port=(
            r.integer(t, prefix, "data_port", DEFAULT_DATA_PORTS[name], ge=1, le=65535)
            if name in DEFAULT_DATA_PORTS else None
        ),
        cores=_cores(r, f"{prefix}.cores", t.get("cores", [])),
        device=device,
    )


def _cores(r: TableReader, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise r.error(key, f"expected an array of core numbers, got {describe(value)}")
    count = os.cpu_count() or 1
    cores: list[int] = []
    for i, core in enumerate(value):
        r.check_integer(core, f"{key}[{i}]", what="a core number", ge=0)
        if core >= count:
            raise r.error(f"{key}[{i}]", f"core {core} does not exist: os.cpu_count() is {count}, "
                          f"so expected 0..{count - 1}")
        if core in cores:
            raise r.error(f"{key}[{i}]", f"core {core} is listed twice")
        cores.append(core)
    return tuple(cores)


def _links(r: TableReader, value: Any) -> tuple[LinkConfig, ...]:
    if not isinstance(value, list):
        raise r.error("links", f"expected an array of tables ([[links]]), got {describe(value)}")
    pairs = " or ".join(f"{s} -> {d}" for s, d in LINK_PAIRS)
    found: dict[tuple[str, str], LinkConfig] = {}
    seen_at: dict[tuple[str, str], str] = {}
    for i, t in enumerate(value):
        key = f"links[{i}]"
        if not isinstance(t, dict):
            raise r.error(key, f"expected a table, got {describe(t)}")
        r.check_keys(t, key, ("src", "dst", "transport", "options"))
        for end in ("src", "dst"):
            if end not in t:
                raise r.error(f"{key}.{end}", f"missing key '{end}'; every link names src and dst ({pairs})")
        src, dst = r.string(t, key, "src", ""), r.string(t, key, "dst", "")
        if (src, dst) not in LINK_PAIRS:
            raise r.error(key, f"no data-plane link {src} -> {dst}; expected {pairs}")
        if (src, dst) in found:
            raise r.error(key, f"link {src} -> {dst} is already defined by {seen_at[(src, dst)]}")
        transport = r.string(t, key, "transport", "tcp", non_empty=True)
        if problem := transport_problem(transport):
            raise r.error(f"{key}.transport", f"transport {transport!r} is not available: {problem}")
        options = t.get("options", {})
        if not isinstance(options, dict):
            raise r.error(f"{key}.options", f"expected a table, got {describe(options)}")
        from pdflow.transports.shaping import check_link_options

        if problem := check_link_options(options):
            raise r.error(f"{key}.options", problem)
        found[(src, dst)], seen_at[(src, dst)] = LinkConfig(src, dst, transport, options), key
    return tuple(found.get(pair) or LinkConfig(*pair) for pair in LINK_PAIRS)
