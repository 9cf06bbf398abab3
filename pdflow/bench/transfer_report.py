"""What ``pdflow bench transfer`` reports: the results document, the printed tables, the targets
(PASS/MISS) and the chart.

Every figure printed comes from the results document, which is also what ``--json`` writes, so
the two never disagree.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pdflow.bench.transfer_cells import KIB, MIB, Budget, Cell, size_label

REFERENCE_SIZES = (64 * KIB, MIB, 16 * MIB)
# (low, high) GB/s at REFERENCE_SIZES, measured beforehand on this machine (not by this run).
REFERENCE = {
    "note": "measured beforehand on this machine, not by this run; GB/s (decimal)",
    "memcpy_256MiB_gbps": 13.5,
    "rows": {
        "plain socket": [[3.4, 3.4], [5.3, 5.3], [4.5, 4.5]],
        "Mooncake transfer engine, tcp": [[0.8, 1.5], [2.0, 2.4], [2.0, 2.2]],
        "NIXL with UCX": [[4.4, 4.4], [9.0, 15.0], [7.6, 9.3]],
    },
}
MOONCAKE = "Mooncake transfer engine, tcp"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def progress_line(cell: Cell) -> str:
    errors = f", {len(cell.errors)} ERRORS" if cell.errors else ""
    p50, p99 = fmt_time(cell.latency(0.5)), fmt_time(cell.latency(0.99))
    return (f"{cell.workload.name:<13} {cell.path:<7} {cell.gbps:6.2f} GB/s  p50 {p50:>9}  p99 {p99:>9}  "
            f"({len(cell.gbps_rounds)} rounds, {cell.seconds:.1f} s{errors})")


# --- the document ------------------------------------------------------------------------------


def results(cells: list[Cell], names: list[str], skipped: dict[str, str], link: dict[str, str],
            budget: Budget, passes: int, machine: dict[str, Any], command: str) -> dict[str, Any]:  # fmt: skip
    by = {(c.path, c.workload.name): c for c in cells}
    workloads = list(dict.fromkeys(c.workload for c in cells))
    doc: dict[str, Any] = {
        "command": command,
        "machine": machine,
        "settings": {"repeat": budget.repeat, "seconds": budget.seconds, "passes": passes, "link": link or None,
                     "transports": names, "not_run": skipped},
        "workloads": [{"name": w.name, "tokens": w.tokens, "chunk_bytes": w.chunk_bytes, "chunks": len(w.spans),
                       "round_bytes": w.round_bytes} for w in workloads],
        "cells": [c.as_json(_baselines(by, c)) for c in cells],
        "reference": REFERENCE,
    }  # fmt: skip
    doc["ahead_of_mooncake"] = _ahead_of_mooncake(doc)
    doc["targets"] = _targets(doc)
    return doc


def _baselines(by: dict[tuple[str, str], Cell], cell: Cell) -> dict[str, float]:
    """GB/s of the baselines ``cell`` is compared with: memcpy and socket; ucx also with ucx-raw."""
    names = ["memcpy", "socket"] + (["ucx-raw"] if cell.path == "ucx" else [])
    return {name: by[(name, cell.workload.name)].gbps for name in names if (name, cell.workload.name) in by}


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _raw(doc: dict[str, Any], path: str, size: int) -> dict[str, Any] | None:
    return next((c for c in doc["cells"] if c["path"] == path and c["workload"].startswith("raw")
                 and c["chunk_bytes"] == size), None)  # fmt: skip


def _ahead_of_mooncake(doc: dict[str, Any]) -> dict[str, list[bool | None]]:
    """Per transport of this run: at each reference size, GB/s above the top of Mooncake-tcp's
    range (None: that size was not run)."""
    tops = [high for _, high in REFERENCE["rows"][MOONCAKE]]
    return {
        name: [None if (cell := _raw(doc, name, size)) is None else cell["gbps"] > top
               for size, top in zip(REFERENCE_SIZES, tops)]
        for name in doc["settings"]["transports"]
    }  # fmt: skip


def _target(name: str, status: str, detail: str) -> dict[str, str]:
    return {"name": name, "status": status, "detail": detail}


def _ratio_target(doc: dict[str, Any], name: str, path: str, baseline: str, floor: float, min_chunk: int = 0):
    if doc["settings"]["link"]:
        return _target(name, "n/a", "the link is shaped; targets are for unshaped runs")
    if path not in doc["settings"]["transports"]:
        why = doc["settings"]["not_run"].get(path, "not chosen with --transports")
        return _target(name, "n/a", f"{path} is not in this run: {why}")
    cells = [c for c in doc["cells"] if c["path"] == path and c["chunk_bytes"] >= min_chunk]
    if not cells:
        return _target(name, "n/a", f"no {path} cell with chunks of {size_label(min_chunk)} or more")
    worst = min(cells, key=lambda c: c["ratio"][baseline])
    misses = [c["workload"] for c in cells if c["ratio"][baseline] < floor]
    detail = f"worst {worst['ratio'][baseline]:.2f}x ({worst['workload']})"
    if misses:
        return _target(name, "MISS", f"{detail}; below in {', '.join(misses)}")
    return _target(name, "PASS", detail)


def _targets(doc: dict[str, Any]) -> list[dict[str, str]]:
    found = [
        _ratio_target(doc, "shm >= 0.8x memcpy from 1 MiB up", "shm", "memcpy", 0.8, MIB),
        _ratio_target(doc, "tcp >= 0.9x plain socket", "tcp", "socket", 0.9),
    ]
    found.append(_ratio_target(doc, "ucx >= 0.9x raw UCX tagged send/recv (ucx-raw)", "ucx", "ucx-raw", 0.9))
    name = "every transport ahead of Mooncake-tcp (top of its range)"
    ahead = doc["ahead_of_mooncake"]
    if doc["settings"]["link"]:
        found.append(_target(name, "n/a", "the link is shaped; targets are for unshaped runs"))
    elif not ahead or all(v is None for flags in ahead.values() for v in flags):
        found.append(_target(name, "n/a", "needs raw chunks of 64 KiB, 1 MiB or 16 MiB"))
    else:
        behind = [f"{t} at {size_label(s)}" for t, flags in ahead.items()
                  for s, flag in zip(REFERENCE_SIZES, flags) if flag is False]  # fmt: skip
        found.append(_target(name, "MISS" if behind else "PASS",
                             f"behind: {', '.join(behind)}" if behind else "ahead at every size run"))
    return found


# --- the printed report --------------------------------------------------------------------------


def render(doc: dict[str, Any]) -> str:
    m, settings = doc["machine"], doc["settings"]
    out = [f"pdflow bench transfer: {m['cpus']} CPUs ({m['cpu'] or 'unknown model'}), load average "
           f"{m['load'][0]:.2f} at start, {m['load_after'][0]:.2f} at the end; Linux {m['kernel']}, "
           f"Python {m['python']}",
           f"repeat with: {doc['command']}"]  # fmt: skip
    if settings["link"]:
        out.append("link shaped for the transports (not the baselines): "
                   + ", ".join(f"{k} {v}" for k, v in settings["link"].items()))
    for name, why in settings["not_run"].items():
        out.append(f"not run: {name}: {why}")
    out += ["", f"GB/s = 10^9 bytes/s, median of the measured rounds (range: slowest-fastest round) of "
            f"{settings['passes']} interleaved passes;",
            "ratios to the memcpy and socket baselines of the same workload in this run;",
            "latency = write() call -> receiver's notice, per chunk.", ""]
    header = (f"{'workload':<13} {'chunk':>9}  {'path':<7} {'GB/s':>7} {'range':>11} {'x memcpy':>9} "
              f"{'x socket':>9} {'p50':>10} {'p99':>10}")
    out += [header, "-" * len(header)]
    for w in doc["workloads"]:
        for i, c in enumerate(c for c in doc["cells"] if c["workload"] == w["name"]):
            first = f"{w['name']:<13} {size_label(w['chunk_bytes']):>9}" if i == 0 else " " * 23
            errors = f"  {len(c['errors'])} errors" if c["errors"] else ""
            if "ucx-raw" in c["ratio"]:
                errors = f"  ({c['ratio']['ucx-raw']:.2f}x ucx-raw){errors}"
            ratio, latency = c["ratio"], c["latency_s"]
            spread = f"{min(c['gbps_rounds']):.2f}-{max(c['gbps_rounds']):.2f}"
            figures = f"{c['gbps']:7.2f} {spread:>11} {ratio['memcpy']:9.2f} {ratio['socket']:9.2f}"
            out.append(f"{first}  {c['path']:<7} {figures} {fmt_time(latency['median']):>10} "
                       f"{fmt_time(latency['p99']):>10}{errors}")
    out += ["", *_orientation(doc), "", "Targets:"]
    out += [f"  {t['status']:<4}  {t['name']}: {t['detail']}" for t in doc["targets"]]
    return "\n".join(out) + "\n"


def _span(low: float, high: float) -> str:
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def _orientation(doc: dict[str, Any]) -> list[str]:
    sizes = "".join(f"{size_label(s):>10}" for s in REFERENCE_SIZES)
    out = [f"Orientation ({REFERENCE['note']}):",
           f"memcpy of one 256 MiB array: {REFERENCE['memcpy_256MiB_gbps']} GB/s",
           f"{'':<32}{sizes}   pdflow ahead of Mooncake-tcp?"]  # fmt: skip
    for label, spans in REFERENCE["rows"].items():
        out.append(f"{label:<32}" + "".join(f"{_span(*s):>10}" for s in spans))
    for name, flags in doc["ahead_of_mooncake"].items():
        figures = [_raw(doc, name, s) for s in REFERENCE_SIZES]
        cells = "".join(f"{'-' if c is None else format(c['gbps'], '.2f'):>10}" for c in figures)
        known = [f for f in flags if f is not None]
        verdict = "n/a" if not known else "yes" if all(known) else "no (" + ", ".join(
            size_label(s) for s, f in zip(REFERENCE_SIZES, flags) if f is False) + ")"
        out.append(f"{'pdflow ' + name + ' (this run)':<32}{cells}   {verdict}")
    return out


# --- the chart -----------------------------------------------------------------------------------


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(doc: dict[str, Any], path: Path) -> None:
    """GB/s by chunk size: a solid line per transport, dashed ones for the baselines, and the
    reference Mooncake-tcp range as grey bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    paths = list(dict.fromkeys(c["path"] for c in doc["cells"]))
    for name in paths:
        cells = sorted((c for c in doc["cells"] if c["path"] == name), key=lambda c: c["chunk_bytes"])
        baseline = cells[0]["baseline"]
        ax.plot([c["chunk_bytes"] for c in cells], [c["gbps"] for c in cells], "--" if baseline else "-",
                marker="" if baseline else "o", linewidth=1.4 if baseline else 2,
                label=f"{name} (baseline)" if baseline else name)  # fmt: skip
    lows, highs = zip(*REFERENCE["rows"][MOONCAKE])
    ax.vlines(REFERENCE_SIZES, lows, highs, colors="0.6", linewidth=6, alpha=0.6,
              label="Mooncake-tcp (reference, not this run)")
    ax.set_xscale("log", base=2)
    kv = {w["chunk_bytes"]: w["name"].removeprefix("kv ") for w in doc["workloads"] if w["tokens"]}
    sizes = sorted({c["chunk_bytes"] for c in doc["cells"]} | set(REFERENCE_SIZES))
    ax.set_xticks(sizes, [size_label(s) + (f"\n{kv[s]}" if s in kv else "") for s in sizes], fontsize=8)
    ax.set_xlabel("chunk size (under it: the prompt length whose per-layer KV chunk it is)")
    ax.set_ylabel("GB/s (10^9 bytes/s)")
    link = doc["settings"]["link"]
    shaped = f", link {', '.join(link.values())}" if link else ""
    load = statistics.mean([doc["machine"]["load"][0], doc["machine"]["load_after"][0]])
    ax.set_title(f"pdflow bench transfer: {doc['machine']['cpus']} CPUs, load ~{load:.1f}{shaped}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
