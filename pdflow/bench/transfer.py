"""``pdflow bench transfer``: how fast each transport moves KV chunks between two processes.

A receiver process (:mod:`pdflow.bench.transfer_peer`) lands chunks and stamps each notice; the
sender, in this process, writes *rounds* of chunks of each workload through each transport, one
awaited ``write()`` after another, as prefill does. The workloads: one request's KV for SmolLM2
(30 layers, 3 KV heads, head_dim 64, float32: a keys and a values chunk per layer, laid out by
:class:`~pdflow.kv.layout.KvLayout`) at 512, 2K and 8K tokens, and raw 64 KiB, 1 MiB and 16 MiB
chunks (``--round-bytes`` of them per round). Beside every transport, from the same run and the
same chunks:

- ``memcpy``: ``numpy.copyto`` of each chunk into a preallocated array, on one core: the limit
  for shared memory;
- ``socket``: a plain blocking socket pair between the same two processes, ``sendall`` /
  ``recv_into`` (TCP_NODELAY, kernel-tuned buffers): the limit for tcp;
- ``ucx-raw``, when ucx runs: UCX tagged send/recv of the payloads alone on the transport's own
  :class:`~pdflow.transports.ucx_worker.UcxWorker`: the floor of what the ucx transport adds.

Definitions. **GB/s** is 10^9 payload bytes per second over a round, from the first ``write()``
call to the last notice; a cell shows the median of its measured rounds. A chunk's **latency**
runs from its ``write()`` call to the moment the receiver's ``next_notice()`` hands it out, both
``time.monotonic()`` (one clock for all processes on a host); writes go one after another, so it
includes waiting behind earlier chunks in the transport's buffers. For memcpy it is one copy.
The first round of every cell is a warm-up (connections, page faults) and is not counted.

Rounds are interleaved: each workload runs every path ``--passes`` times in turn, the order
rotated each pass, and a cell's median is over the rounds of all its passes. Baselines and
transports so see the same machine: a burst of other work lowers all of them, not one.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pdflow import transports
from pdflow.bench import transfer_report
from pdflow.bench.transfer_cells import (
    DEFAULT_RAW,
    DEFAULT_TOKENS,
    KIB,
    MIB,
    Budget,
    Cell,
    Source,
    memcpy_cell,
    socket_cell,
    transport_cell,
    ucx_raw_cell,
    workloads,
)
from pdflow.bench.transfer_peer import Receiver

DESCRIPTION = """\
Stream KV chunks through each KV transport between two processes on this machine (a receiver
process is spawned; this one sends) and print GB/s and per-chunk latency beside two baselines
measured in the same run on the same chunks: memcpy (numpy.copyto on one core, the limit for
shared memory) and a plain blocking socket pair (sendall/recv_into, the limit for tcp), as ratios;
with ucx also raw UCX tagged send/recv of the payloads alone (ucx-raw).

Workloads: one request's KV cache of SmolLM2 (30 layers x keys and values, 3 KV heads, head_dim
64, float32) at 512, 2K and 8K prompt tokens, and raw 64 KiB, 1 MiB and 16 MiB chunks. Writes
are awaited one after another, as prefill sends layers. GB/s = 10^9 bytes/s from the first
write() call to the last notice, median of the measured rounds; latency = from a chunk's write()
call to the receiver's notice of it (time.monotonic in both processes). The first round of each
cell is a warm-up. Paths take turns: every workload runs all paths --passes times, in rotating
order, so baselines and transports share the same machine conditions. A reference table
measured beforehand (Mooncake, NIXL) is printed for orientation, and the targets as PASS/MISS
lines. Progress goes to stderr, the report to stdout.

examples:
  pdflow bench transfer                               every usable transport, default sizes
  pdflow bench transfer --transports tcp --json t.json --plot t.png
  pdflow bench transfer --link-bandwidth 10Gbit --link-latency 250us
"""


def pick_transports(wanted: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The transports to run (those asked for, else every one usable across processes here) and
    why each other known one is not run."""
    names = transports.names()
    skipped: dict[str, str] = {}
    usable = []
    for name in names:
        problem = transports.availability(name)
        if problem is None and not transports.load(name).cross_process:
            problem = "connects peers inside one process only"
        if problem is None:
            usable.append(name)
        else:
            skipped[name] = problem
    if wanted is None:
        return usable, skipped
    for name in wanted:
        if name not in usable:
            why = skipped.get(name) or "unknown; known: " + ", ".join(names)
            raise SystemExit(f"error: transport {name!r} cannot be benchmarked here: {why}")
    return wanted, {n: r for n, r in skipped.items() if n not in wanted}


def machine() -> dict[str, Any]:
    """What the figures depend on: CPUs, their model, the load average now, kernel, Python."""
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "load": list(os.getloadavg()),
            "kernel": platform.release(), "python": platform.python_version()}


def run(args: argparse.Namespace, progress=sys.stderr) -> dict[str, Any]:
    """Run every cell and return the results (the JSON document)."""
    import uvloop

    names, skipped = pick_transports(args.transports)
    link = {k: v for k, v in (("bandwidth", args.link_bandwidth), ("latency", args.link_latency)) if v}
    budget = Budget(args.repeat, args.seconds)
    per_pass = budget.split(args.passes)
    host = machine()
    chosen = workloads(tuple(args.kv_tokens), tuple(args.raw_sizes), args.round_bytes)
    baselines = ("memcpy", "socket", *(["ucx-raw"] if "ucx" in names else []))
    paths = (*baselines, *names)
    total, done = len(chosen) * len(paths) * args.passes, 0
    cells: dict[tuple[str, str], Cell] = {}
    receiver = Receiver()
    try:
        for workload in chosen:
            source = Source.of(workload)
            for turn in range(args.passes):
                for path in rotated(paths, turn):
                    started = time.monotonic()
                    if path == "memcpy":
                        cell = memcpy_cell(workload, source, per_pass)
                    elif path == "socket":
                        cell = socket_cell(receiver, workload, source, per_pass)
                    elif path == "ucx-raw":
                        cell = uvloop.run(ucx_raw_cell(receiver, workload, source, per_pass))
                    else:
                        cell = uvloop.run(transport_cell(receiver, path, link, workload, source, per_pass))
                    cell.seconds = time.monotonic() - started
                    merged = cells.setdefault((workload.name, path), cell)
                    if merged is not cell:
                        merged.merge(cell)
                    done += 1
                    progress.write(f"[{done:>3}/{total}] pass {turn + 1}: {transfer_report.progress_line(cell)}\n")
                    progress.flush()
    finally:
        receiver.close()
    host["load_after"] = list(os.getloadavg())
    return transfer_report.results(list(cells.values()), names, skipped, link, budget, args.passes, host,
                                   command_line(args))


def rotated(paths: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """``paths`` starting at a different one each pass, so that no path always runs right after
    the same neighbour (a slow one leaves caches and frequency behind)."""
    k = turn % len(paths)
    return paths[k:] + paths[:k]


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run (outputs left out)."""
    words = ["pdflow", "bench", "transfer", "--repeat", str(args.repeat), "--seconds", f"{args.seconds:g}",
             "--passes", str(args.passes)]
    if args.transports:
        words += ["--transports", ",".join(args.transports)]
    if tuple(args.kv_tokens) != DEFAULT_TOKENS:
        words += ["--kv-tokens", ",".join(map(str, args.kv_tokens))]
    if tuple(args.raw_sizes) != DEFAULT_RAW:
        words += ["--raw-sizes", ",".join(map(str, args.raw_sizes))]
    if args.round_bytes != 64 * MIB:
        words += ["--round-bytes", str(args.round_bytes)]
    for flag, value in (("--link-bandwidth", args.link_bandwidth), ("--link-latency", args.link_latency)):
        if value:
            words += [flag, value]
    return shlex.join(words)


# --- command line ------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KIB": KIB, "MIB": MIB, "GIB": 1 << 30, "K": KIB, "M": MIB, "G": 1 << 30}


def _count(text: str) -> int:
    """``"64KiB"``, ``"1MiB"``, ``"2K"`` (binary: K = 1024), ``"512"`` -> a positive int."""
    digits = text.strip().rstrip("BbIiKkMmGg") or "x"
    unit = text.strip()[len(digits):].upper()
    if not digits.isdigit() or unit not in _UNITS or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number, optionally with "
                                         "K, M, G (binary) or KiB, MiB, GiB, e.g. 64KiB or 2K")
    return int(digits) * _UNITS[unit]


def _counts(text: str) -> list[int]:
    return [_count(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _link_option(parse):
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pdflow bench transfer``."""
    from pdflow.transports.shaping import parse_bandwidth, parse_latency

    parser.add_argument("--transports", type=_names, metavar="NAMES",
                        help="comma-separated transports to run, e.g. tcp,shm (default: every "
                        "transport usable across processes here)")
    parser.add_argument("--repeat", type=int, default=5, metavar="N",
                        help="measured rounds per cell at most, split over the passes (rounded up), each "
                        "pass after one warm-up round (default: 5)")
    parser.add_argument("--seconds", type=float, default=3.0, metavar="S",
                        help="time budget per cell: no new round starts after S seconds; at least "
                        "one round per pass is measured (default: 3)")
    parser.add_argument("--passes", type=int, default=3, metavar="P",
                        help="interleave: each workload runs every path P times in turn (rotating "
                        "the order), each time with 1/P of the rounds and seconds after its own "
                        "warm-up, so that baselines and transports share the machine's moods (default: 3)")
    parser.add_argument("--kv-tokens", type=_counts, default=list(DEFAULT_TOKENS), metavar="LIST",
                        help="prompt lengths of the KV workloads, e.g. 512,2K,8K (the default; K = 1024)")
    parser.add_argument("--raw-sizes", type=_counts, default=list(DEFAULT_RAW), metavar="LIST",
                        help="chunk sizes of the raw workloads (default: 64KiB,1MiB,16MiB)")
    parser.add_argument("--round-bytes", type=_count, default=64 * MIB, metavar="SIZE",
                        help="bytes per round of a raw workload (default: 64MiB)")
    parser.add_argument("--link-bandwidth", type=_link_option(parse_bandwidth), metavar="RATE",
                        help="emulate a link of this bandwidth for the transports, e.g. 10Gbit or 2GB "
                        "(per second; the baselines stay unshaped)")
    parser.add_argument("--link-latency", type=_link_option(parse_latency), metavar="TIME",
                        help="and this one-way latency, e.g. 250us or 1ms")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument("--plot", type=Path, metavar="FILE",
                        help="also draw GB/s by chunk size to FILE (PNG; needs matplotlib: "
                        "pip install 'pdflow[bench]')")


def main(args: argparse.Namespace) -> int:
    """Run, print the report to stdout, write --json and --plot; 0 unless something failed."""
    from pdflow.log import configure_logging

    if args.repeat < 1 or args.seconds <= 0 or args.passes < 1:
        raise SystemExit("error: --repeat and --passes must be >= 1 and --seconds > 0")
    if args.plot is not None and not transfer_report.can_plot():
        raise SystemExit("error: --plot needs matplotlib: pip install 'pdflow[bench]'")
    configure_logging("console", "warning", stage="bench")
    results = run(args)
    sys.stdout.write(transfer_report.render(results))
    if args.json is not None:
        args.json.write_text(transfer_report.to_json(results))
    if args.plot is not None:
        transfer_report.plot(results, args.plot)
    return 1 if any(cell["errors"] for cell in results["cells"]) else 0
