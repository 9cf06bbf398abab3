"""``topology.toml`` -> a :class:`~pdflow.config.pipeline.Pipeline`.

``load_topology("topology.toml")`` decodes the file and checks everything that can be checked
before a process starts (types, ranges, stage kinds and outputs, port clashes, installed
transports, the router, the model's directory), so a bad file fails at once with
``path:line: key: what is expected`` (:class:`TopologyError`) instead of as a hung or crashed
stage later. The checks that do not depend on TOML are the pipeline's own
(:func:`pdflow.config.checks.check_pipeline`), so a pipeline built in code gets them too.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from pdflow.config.checks import check_pipeline, known_models
from pdflow.transports import shares_memory
from pdflow.transports.shaping import parse_size
from pdflow.config.pipeline import (
    DEFAULT_DATA_PORTS,
    DEFAULT_PORTS,
    DEFAULT_WEIGHTS,
    DTYPES,
    KV_STREAMING,
    LINK_PAIRS,
    LOCALITIES,
    MODES,
    OPTIONAL_STAGE_NAMES,
    STAGE_NAMES,
    ControlConfig,
    EngineConfig,
    HostConfig,
    KvConfig,
    Limits,
    LinkConfig,
    ModelConfig,
    Pipeline,
    PipelineError,
    RouterConfig,
    SecurityConfig,
    ServerConfig,
    ScalerConfig,
    SpeculativeConfig,
    StageConfig,
    default_stage,
    free_plugin_port,
    route_tokens_through,
)
from pdflow.config.overrides import Override, OverrideError
from pdflow.config.overrides import apply as apply_overrides
from pdflow.config.toml_lines import LineMap
from pdflow.model_files import ModelFileError
from pdflow.model_files import describe as describe_model
from pdflow.models import hub_id_hint
from pdflow.config.toml_reader import TableReader, TopologyError, describe, syntax_error

__all__ = ["STAGE_NAMES", "DTYPES", "Limits", "Pipeline", "TopologyError", "load_topology", "parse_topology"]

_MODEL_STAGES = ("prefill", "decode", "worker")  # the built-in stages that take a device
_STAGE_KEYS = ("kind", "replicas", "min_replicas", "on", "host", "port", "data_port", "cores", "device", "outputs", "options")
_HOST_NAME = re.compile(r"[A-Za-z0-9_-]+")
_WILDCARD_ADDRESSES = ("0.0.0.0", "::", "*", "[::]")


DEFAULTS_PATH = "(defaults)"  # the "file" of a topology given by command-line flags alone


def load_topology(path: str | Path | None, overrides: list[Override] = ()) -> Pipeline:
    """The topology of file ``path`` (None: the defaults, relative paths from the working
    directory), with command-line ``overrides`` written over it."""
    if path is None:
        return parse_topology("", Path(DEFAULTS_PATH), overrides)
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise TopologyError(path, None, "(file)", f"cannot read the topology file: {reason}") from None
    return parse_topology(text, path, overrides)


def parse_topology(text: str, path: Path, overrides: list[Override] = ()) -> Pipeline:
    """Decode and check topology ``text``; ``path`` is for messages and resolving relative paths;
    ``overrides`` (command-line flags) are written over the file's tables first."""
    path, lines = Path(path), LineMap(text)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise syntax_error(path, lines, e, text) from None
    try:
        apply_overrides(raw, list(overrides))
    except OverrideError as e:
        raise TopologyError(path, None, "(command line)", str(e)) from None
    for override in overrides:
        lines.set_by(override.key, override.flag)
    r = TableReader(path, lines)
    r.check_keys(raw, "", ("model", "server", "control", "limits", "engine", "router", "speculative", "kv", "security",
                             "scaler", "hosts", "stages", "links"))
    engine = _engine(r, r.table(raw, "", "engine", ("mode", "kv_streaming", "chunked_prefill_tokens")))
    hosts = _hosts(r, raw)
    control = _control(r, raw, hosts)
    stages = _stage_tables(r, raw)
    pipeline = Pipeline(
        path=path.absolute(),
        model=_model(r, r.table(raw, "", "model", ("source", "dtype", "served_name", "weights", "max_model_len")), path),
        server=_server(r, r.table(raw, "", "server", [f.name for f in fields(ServerConfig)])),
        control=control,
        limits=_limits(r, r.table(raw, "", "limits", [f.name for f in fields(Limits)])),
        stages=_stages(r, stages, engine.mode, hosts, control.on),
        links=_links(r, raw.get("links", []), engine.mode, path),
        engine=engine,
        router=_router(r, r.table(raw, "", "router", ("policy", "options", "locality"))),
        speculative=_speculative(r, r.table(raw, "", "speculative", [f.name for f in fields(SpeculativeConfig)])),
        scaler=_scaler(r, r.table(raw, "", "scaler", [f.name for f in fields(ScalerConfig)])),
        kv=_kv(r, r.table(raw, "", "kv", [f.name for f in fields(KvConfig)]), path),
        security=_security(r, r.table(raw, "", "security", [f.name for f in fields(SecurityConfig)]), path),
        hosts=hosts,
    )
    if pipeline.colocated and raw.get("links"):
        raise r.error("links", "a colocated topology has no data-plane links (its worker keeps the KV); "
                      "remove the [[links]] tables or set engine.mode = \"disaggregated\"")
    try:
        check_pipeline(pipeline, written=lambda key: lines.line_of(key) is not None or lines.flag_of(key) is not None)
    except PipelineError as e:
        raise r.error(e.key, e.message) from None
    return pipeline


def _model(r: TableReader, t: dict[str, Any], topology_path: Path) -> ModelConfig:
    source = r.string(t, "model", "source", "smollm2", non_empty=True)
    dtype = r.string(t, "model", "dtype", "float32", choices=DTYPES)
    served_name = r.string(t, "model", "served_name", "")
    weights = r.string(t, "model", "weights", DEFAULT_WEIGHTS, non_empty=True)
    max_model_len = r.integer(t, "model", "max_model_len", 1, ge=1) if "max_model_len" in t else None
    is_path = "/" in source or source.startswith((".", "~")) or source.lower().endswith(".gguf")
    if not is_path:
        known = known_models()
        if source not in known:
            close = difflib.get_close_matches(source, list(known), n=1)
            hint = f"did you mean '{close[0]}'? Known models: " if close else "expected one of "
            raise r.error("model.source", f"unknown model '{source}'; {hint}{', '.join(sorted(known))}, "
                          "or a path to a GGUF file or a local Hugging Face model directory (e.g. ./models/my-model)")
        return ModelConfig(source, dtype, served_name or source, False, None, weights, max_model_len)
    path = (topology_path.absolute().parent / Path(source).expanduser()).resolve()
    if not path.exists() and (hint := hub_id_hint(source)):
        raise r.error("model.source", hint)
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise r.error("model.source", f"{path} is a file but not a GGUF file (*.gguf); give a GGUF file or a "
                      "Hugging Face model directory")
    if not path.exists():
        raise r.error("model.source", f"{'GGUF file' if path.suffix.lower() == '.gguf' else 'model directory'} "
                      f"{path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise r.error("model.source", f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        facts = describe_model(path)
    except ModelFileError as exc:
        raise r.error("model.source", str(exc)) from None
    if facts.fallback_reason is not None and weights not in ("fp32", DEFAULT_WEIGHTS):
        raise r.error("model.weights", f"weights = {weights!r} needs the compact engine, which cannot run this "
                      f"model ({facts.fallback_reason}); use weights = \"fp32\" (the transformers fallback)")
    name = path.stem if path.is_file() else path.name
    return ModelConfig(source, dtype, served_name or name, True, path, weights, max_model_len)


def _size(r: TableReader, t: dict[str, Any], table: str, name: str, default: int) -> int:
    """A size in bytes: ``"4GiB"`` or an integer."""
    try:
        return parse_size(t.get(name, default), name)
    except ValueError as exc:
        raise r.error(f"{table}.{name}", str(exc)) from None


def _server(r: TableReader, t: dict[str, Any]) -> ServerConfig:
    d = ServerConfig()
    return ServerConfig(
        **_endpoint(r, {"server": {k: v for k, v in t.items() if k in ("host", "port")}}, "server", d),
        max_body_bytes=_size(r, t, "server", "max_body_bytes", d.max_body_bytes),
        header_timeout_s=r.number(t, "server", "header_timeout_s", d.header_timeout_s, gt=0),
        max_messages=r.integer(t, "server", "max_messages", d.max_messages, ge=1),
        metrics_open=r.boolean(t, "server", "metrics_open", d.metrics_open),
        reuse_port=r.boolean(t, "server", "reuse_port", d.reuse_port),
    )


def _security(r: TableReader, t: dict[str, Any], topology_path: Path) -> SecurityConfig:
    d = SecurityConfig()
    files = {}
    for name in ("secret_file", "api_key_file"):
        value = r.string(t, "security", name, "")
        files[name] = (topology_path.absolute().parent / Path(value).expanduser()) if value else None
    for file, env in (("secret_file", "secret_env"), ("api_key_file", "api_key_env")):
        if files[file] is not None and t.get(env):
            raise r.error(f"security.{env}", f"set security.{file} or security.{env}, not both")
    return SecurityConfig(
        secret_file=files["secret_file"], secret_env=r.string(t, "security", "secret_env", d.secret_env),
        api_key_file=files["api_key_file"], api_key_env=r.string(t, "security", "api_key_env", d.api_key_env),
        authenticate=r.boolean(t, "security", "authenticate", d.authenticate),
    )


def _hosts(r: TableReader, raw: dict[str, Any]) -> dict[str, HostConfig]:
    """``[hosts.NAME]`` tables: the machines of a pipeline that spans several."""
    tables = raw.get("hosts", {})
    if not isinstance(tables, dict):
        raise r.error("hosts", f"expected a table of hosts ([hosts.NAME] with address = ...), got {describe(tables)}")
    hosts = {}
    for name in tables:
        key = f"hosts.{name}"
        if not _HOST_NAME.fullmatch(name):
            raise r.error(key, f"a host's name is letters, digits, '-' and '_' (it is what `pdflow run --node` "
                          f"takes), got {name!r}")
        t = r.table(tables, "hosts", name, ("address", "bind"))
        if "address" not in t:
            raise r.error(key, f"missing key 'address': where the other machines reach host {name!r} "
                          '(e.g. address = "10.0.0.2")')
        address = r.string(t, key, "address", "", non_empty=True)
        if address in _WILDCARD_ADDRESSES:
            raise r.error(f"{key}.address", f"{address!r} is not an address other machines can reach; put the "
                          f"routable address here and {address!r} in {key}.bind")
        hosts[name] = HostConfig(name, address, r.string(t, key, "bind", "", non_empty="bind" in t))
    return hosts


def _control(r: TableReader, raw: dict[str, Any], hosts: dict[str, HostConfig]) -> ControlConfig:
    """``[control]``: where the supervising launcher listens; with ``[hosts]``, on the host ``on``
    names (the first host by default), at that host's address."""
    t = r.table(raw, "", "control", ("host", "port", "on"))
    default = ControlConfig()
    port = r.integer(t, "control", "port", default.port, ge=1, le=65534)
    if not hosts:
        if "on" in t:
            raise r.error("control.on", "control.on names a host, but this topology has no [hosts] tables")
        return ControlConfig(r.string(t, "control", "host", default.host, non_empty=True), port)
    if "host" in t:
        raise r.error("control.host", "with [hosts], the launcher's address is its host's: set control.on to "
                      "the host's name instead")
    on = r.string(t, "control", "on", next(iter(hosts)), non_empty=True)
    placed = _host_named(r, "control.on", on, hosts)
    return ControlConfig(placed.address, port, placed.bind, on)


def _host_named(r: TableReader, key: str, name: str, hosts: dict[str, HostConfig]) -> HostConfig:
    if name not in hosts:
        close = difflib.get_close_matches(name, list(hosts), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise r.error(key, f"no host named {name!r}; {hint}the hosts are {', '.join(hosts)}")
    return hosts[name]


def _placement(r: TableReader, prefix: str, t: dict[str, Any], replicas: int, hosts: dict[str, HostConfig],
               default: str) -> tuple[HostConfig, ...]:
    """A stage's ``on``: one host's name (every replica there) or one per replica."""
    if not hosts:
        if "on" in t:
            raise r.error(f"{prefix}.on", f"{prefix}.on names a host, but this topology has no [hosts] tables "
                          '(add [hosts.NAME] with address = ... for each machine)')
        return ()
    if "host" in t:
        raise r.error(f"{prefix}.host", f"with [hosts], a stage's address is its host's: remove {prefix}.host and "
                      f"place it with {prefix}.on (the address is [hosts.NAME] address, bind)")
    value = t.get("on", default)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        raise r.error(f"{prefix}.on", f"expected a host's name or an array of one per replica, got {describe(value)}")
    if len(names) not in (1, replicas):
        raise r.error(f"{prefix}.on", f"expected one host for every replica or one per replica ({replicas}), "
                      f"got {len(names)}")
    return tuple(_host_named(r, f"{prefix}.on" + (f"[{i}]" if isinstance(value, list) else ""),
                             r.string({"on": n}, prefix, "on", "", non_empty=True), hosts)
                 for i, n in enumerate(names))


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
        max_migrations=r.integer(t, "limits", "max_migrations", d.max_migrations, ge=0),
    )


def _heartbeat_timeout(r: TableReader, t: dict[str, Any], interval: float) -> float:
    timeout = r.number(t, "limits", "heartbeat_timeout_s", Limits().heartbeat_timeout_s, gt=0)
    if timeout <= interval:
        raise r.error("limits.heartbeat_timeout_s", f"expected a number > limits.heartbeat_interval_s "
                      f"({interval}) so that one late heartbeat is not a death, got {timeout}")
    return timeout


def _kv(r: TableReader, t: dict[str, Any], topology_path: Path) -> KvConfig:
    d = KvConfig()
    store_bytes = _size(r, t, "kv", "store_bytes", d.store_bytes)
    high = r.number(t, "kv", "high_watermark", d.high_watermark, gt=0)
    low = r.number(t, "kv", "low_watermark", d.low_watermark, gt=0)
    if high > 1:
        raise r.error("kv.high_watermark", f"expected a fraction <= 1, got {high}")
    if low > high:
        raise r.error("kv.low_watermark", f"expected a fraction <= kv.high_watermark ({high}), got {low}")
    return KvConfig(
        prefix_cache=r.boolean(t, "kv", "prefix_cache", d.prefix_cache),
        block_tokens=r.integer(t, "kv", "block_tokens", d.block_tokens, ge=1, le=8192),
        store_bytes=store_bytes, high_watermark=high, low_watermark=low,
        decode_pool_bytes=_size(r, t, "kv", "decode_pool_bytes", d.decode_pool_bytes),
        zero_copy=r.boolean(t, "kv", "zero_copy", d.zero_copy),
        **_disk(r, t, topology_path, d),
        block_ttl_s=r.number(t, "kv", "block_ttl_s", d.block_ttl_s, gt=0),
        prefetch=r.boolean(t, "kv", "prefetch", d.prefetch),
        codec=(codec := r.string(t, "kv", "codec", d.codec, non_empty=True)),
        codec_options=_codec_options(r, t, "kv", codec, topology_path),
        direct=r.boolean(t, "kv", "direct", d.direct),
    )


def _disk(r: TableReader, t: dict[str, Any], topology_path: Path, d: KvConfig) -> dict[str, Any]:
    """The disk tier's keys: a directory (relative to the topology file) and its sizes."""
    value = r.string(t, "kv", "disk_path", "")
    capacity = _size(r, t, "kv", "disk_capacity", d.disk_capacity)
    segment = _size(r, t, "kv", "disk_segment_bytes", d.disk_segment_bytes)
    if not value:
        for name in ("disk_capacity", "disk_segment_bytes"):
            if name in t:
                raise r.error(f"kv.{name}", "a disk tier setting without kv.disk_path; set the directory too")
        return {}
    path = (topology_path.absolute().parent / Path(value).expanduser()).resolve()
    if path.exists() and not path.is_dir():
        raise r.error("kv.disk_path", f"{path} exists and is not a directory")
    if segment < 1 << 20:
        raise r.error("kv.disk_segment_bytes", f"expected at least 1MiB, got {segment} bytes")
    if capacity < 2 * segment:
        raise r.error("kv.disk_capacity", f"expected at least two segments (kv.disk_segment_bytes = {segment} "
                                          f"bytes), got {capacity} bytes")
    return {"disk_path": path, "disk_capacity": capacity, "disk_segment_bytes": segment}


def _engine(r: TableReader, t: dict[str, Any]) -> EngineConfig:
    mode = r.string(t, "engine", "mode", "disaggregated", choices=tuple(MODES))
    streaming = r.string(t, "engine", "kv_streaming", "layer", choices=KV_STREAMING)
    chunk = r.integer(t, "engine", "chunked_prefill_tokens", 0, ge=0)
    if chunk and mode != "colocated":
        raise r.error("engine.chunked_prefill_tokens",
                      "chunked prefill is a colocated-worker setting; set engine.mode = \"colocated\" or 0")
    return EngineConfig(mode, streaming, chunk)


def _stage_tables(r: TableReader, raw: dict[str, Any]) -> dict[str, Any]:
    stages = raw.get("stages", {})
    if not isinstance(stages, dict):
        raise r.error("stages", f"expected a table, got {describe(stages)}")
    return stages


def _stages(r: TableReader, tables: dict[str, Any], mode: str, hosts: dict[str, HostConfig],
            control_on: str) -> dict[str, StageConfig]:
    """The mode's built-in stages (each from its table, or defaults), then every other stage in
    file order; a stage of another kind names it with ``kind``. With ``[hosts]``, a stage
    without ``on`` runs on the launcher's host (``control.on``)."""
    wanted = MODES[mode]
    for name in tables:
        if name in DEFAULT_PORTS and name not in wanted and name not in OPTIONAL_STAGE_NAMES:
            raise r.error(f"stages.{name}", f"a {mode} topology has no {name} stage; its stages are "
                          f"{', '.join(wanted)} (engine.mode picks the set), and optionally "
                          f"{', '.join(OPTIONAL_STAGE_NAMES)}")
    optional = [name for name in OPTIONAL_STAGE_NAMES if name in tables]
    place = (hosts, control_on)
    stages = {name: _stage(r, name, r.table(tables, "stages", name, _STAGE_KEYS), mode, place)
              for name in (*wanted, *optional)}
    if "egress" in stages:  # an egress stage detokenizes instead of ingress
        stages = route_tokens_through(stages, mode, "egress")
    for name in tables:
        if name not in stages:
            stages[name] = _stage(r, name, r.table(tables, "stages", name, _STAGE_KEYS), mode, place, stages)
    return stages


def _stage(r: TableReader, name: str, t: dict[str, Any], mode: str, place: tuple[dict[str, HostConfig], str],
           earlier: dict[str, StageConfig] | None = None) -> StageConfig:
    prefix = f"stages.{name}"
    builtin = earlier is None
    if not builtin and "kind" not in t:
        close = difflib.get_close_matches(name, list(DEFAULT_PORTS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise r.error(prefix, f"unknown stage '{name}'; {hint}the built-in stages are {', '.join(DEFAULT_PORTS)}; "
                      'a stage of another kind names it, e.g. kind = "mypkg.module:MyStage"')
    if "data_port" in t and builtin and name not in DEFAULT_DATA_PORTS:
        raise r.error(f"{prefix}.data_port",
                      f"only {', '.join(DEFAULT_DATA_PORTS)} receive KV data; remove data_port from [{prefix}]")
    device = t.get("device", "cpu")
    if builtin and isinstance(device, str) and device != "cpu" and name not in _MODEL_STAGES:
        raise r.error(f"{prefix}.device", f"only {', '.join(_MODEL_STAGES)} run the model; {name} keeps what it "
                      f"holds in host memory: remove device from [{prefix}]")
    replicas = r.integer(t, prefix, "replicas", 1, ge=1)
    config: dict[str, Any] = {
        "replicas": replicas,
        "min_replicas": r.integer(t, prefix, "min_replicas", replicas, ge=1, le=replicas) if "min_replicas" in t else None,
        "placement": _placement(r, prefix, t, replicas, *place),
        "host": r.string(t, prefix, "host", "127.0.0.1", non_empty=True),
        "cores": _cores(r, f"{prefix}.cores", t.get("cores", [])),
        "device": r.string(t, prefix, "device", "cpu"),
        "kind": r.string(t, prefix, "kind", "", non_empty="kind" in t),
        "outputs": _string_table(r, t, prefix, "outputs"),
        "options": _table(r, t, prefix, "options"),
    }
    if "port" in t or not builtin:
        config["port"] = r.integer(t, prefix, "port", free_plugin_port(earlier or {}), ge=1, le=65535)
    if "data_port" in t:
        config["data_port"] = r.integer(t, prefix, "data_port", 0, ge=1, le=65535)
    if builtin:
        return default_stage(name, mode, **config)
    return StageConfig(name=name, **config)


def _table(r: TableReader, t: dict[str, Any], prefix: str, name: str) -> dict[str, Any]:
    value = t.get(name, {})
    if not isinstance(value, dict):
        raise r.error(f"{prefix}.{name}", f"expected a table, got {describe(value)}")
    return value


def _codec_options(r: TableReader, t: dict[str, Any], prefix: str, codec: str, topology_path: Path) -> dict[str, Any]:
    """A ``codec_options`` table, with the codec's file parameters (``path_params``) that are
    relative paths made relative to the topology's folder."""
    options = _table(r, t, prefix, "codec_options")
    if not options or codec == "none":
        return options
    from pdflow.kv.codecs import registry

    try:
        names = getattr(registry.load(codec), "path_params", ())
    except (LookupError, ImportError):
        return options  # the pipeline's checks name the codec that cannot be had
    resolved = dict(options)
    for name in names:
        value = resolved.get(name)
        if isinstance(value, str) and ("/" in value or value.endswith(".json")):
            resolved[name] = str((topology_path.absolute().parent / Path(value).expanduser()).resolve())
    return resolved


def _string_table(r: TableReader, t: dict[str, Any], prefix: str, name: str) -> dict[str, str]:
    value = _table(r, t, prefix, name)
    for key in value:
        r.string(value, f"{prefix}.{name}", key, "", non_empty=True)
    return dict(value)


def _speculative(r: TableReader, t: dict[str, Any]) -> SpeculativeConfig:
    d = SpeculativeConfig()
    return SpeculativeConfig(
        method=r.string(t, "speculative", "method", d.method, non_empty=True),
        num_tokens=r.integer(t, "speculative", "num_tokens", d.num_tokens, ge=1, le=64),
        adaptive=r.boolean(t, "speculative", "adaptive", d.adaptive),
        max_rows=r.integer(t, "speculative", "max_rows", d.max_rows, ge=2),
        row_cost=r.number(t, "speculative", "row_cost", d.row_cost, ge=0),
        probe_every=r.integer(t, "speculative", "probe_every", d.probe_every, ge=1),
        options=_table(r, t, "speculative", "options"),
    )


def _scaler(r: TableReader, t: dict[str, Any]) -> ScalerConfig:
    d = ScalerConfig()
    values = {f.name: r.number(t, "scaler", f.name, getattr(d, f.name), gt=0) for f in fields(ScalerConfig)}
    return ScalerConfig(**values)


def _router(r: TableReader, t: dict[str, Any]) -> RouterConfig:
    policy = r.string(t, "router", "policy", "round_robin", non_empty=True)
    locality = r.string(t, "router", "locality", RouterConfig().locality, choices=LOCALITIES)
    return RouterConfig(policy, _table(r, t, "router", "options"), locality)


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


def _links(r: TableReader, value: Any, mode: str, topology_path: Path) -> tuple[LinkConfig, ...]:
    """The [[links]] tables. In the disaggregated mode a built-in pair not written is tcp, except
    the return links (kv_shuttle -> prefill, decode -> kv_shuttle): they default to the link
    prefill -> kv_shuttle (transport, options and codec), so one setting moves all KV (and
    kv_shuttle receives over one transport). One exception: where prefill -> kv_shuttle shares
    memory (shm: a store beside each prefill host) and kv_shuttle -> decode does not, decode's
    answers come back over the transport (and options) of kv_shuttle -> decode, which reaches it."""
    if not isinstance(value, list):
        raise r.error("links", f"expected an array of tables ([[links]]), got {describe(value)}")
    found: dict[tuple[str, str], LinkConfig] = {}
    for i, t in enumerate(value):
        key = f"links[{i}]"
        if not isinstance(t, dict):
            raise r.error(key, f"expected a table, got {describe(t)}")
        r.check_keys(t, key, ("src", "dst", "transport", "options", "codec", "codec_options"))
        for end in ("src", "dst"):
            if end not in t:
                pairs = " or ".join(f"{s} -> {d}" for s, d in LINK_PAIRS)
                raise r.error(f"{key}.{end}", f"missing key '{end}'; every link names src and dst ({pairs})")
        src, dst = r.string(t, key, "src", ""), r.string(t, key, "dst", "")
        if (src, dst) in found:
            raise r.error(key, f"link {src} -> {dst} is already defined by "
                          f"links[{list(found).index((src, dst))}]")
        transport = r.string(t, key, "transport", "tcp", non_empty=True)
        codec = r.string(t, key, "codec", "none", non_empty=True)
        found[(src, dst)] = LinkConfig(src, dst, transport, _table(r, t, key, "options"), codec,
                                       _codec_options(r, t, key, codec, topology_path))
    if mode == "disaggregated":
        for pair in LINK_PAIRS:
            model = found.get(("prefill", "kv_shuttle")) if pair in _RETURN_LINKS else None
            carrier = model
            into_decode = found.get(("kv_shuttle", "decode"))
            if pair == ("decode", "kv_shuttle") and model is not None and shares_memory(model.transport) and \
                    not shares_memory(into_decode.transport if into_decode else "tcp"):
                carrier = into_decode or LinkConfig("kv_shuttle", "decode")
            found.setdefault(pair, LinkConfig(*pair) if model is None else
                             LinkConfig(*pair, transport=carrier.transport, options=carrier.options,
                                        codec=model.codec, codec_options=model.codec_options))
    return tuple(found.values())



_RETURN_LINKS = (("kv_shuttle", "prefill"), ("decode", "kv_shuttle"))
