"""PNG plots of benchmark runs (matplotlib, Agg): latency CDFs, TBT over time, goodput vs rate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pdflow.bench.metrics import mooncake_tbt


def available() -> bool:
    """matplotlib is installed (found, not imported: the import takes 0.3 s of CPU)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_cdfs(runs: list[dict], path: Path) -> Path:
    """One panel each for TTFT, TBT (all gaps, and Mooncake's per request) and E2E; a line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("TTFT", lambda rs: [r["ttft_s"] * 1000 for r in rs]),
        ("TBT, every gap", lambda rs: [g * 1000 for r in rs for g in r["gaps_s"]]),
        ("TBT, Mooncake (mean of longest 10% per request)",
         lambda rs: [t * 1000 for r in rs if (t := mooncake_tbt(r["gaps_s"])) is not None]),
        ("E2E latency", lambda rs: [r["e2e_s"] * 1000 for r in rs]),
    ]
    for ax, (title, values) in zip(axes, panels):
        for run in runs:
            ok = [r for r in run["records"] if r["error"] is None]
            _cdf(ax, values(ok), run["label"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_tbt_over_time(run: dict, path: Path) -> Path:
    """Every gap at the wall time its later token arrived, from the start of the run."""
    plt = _pyplot()
    xs, ys = [], []
    for r in run["records"]:
        if r["error"] is not None:
            continue
        t = r["sent_s"] + r["ttft_s"]
        for gap in r["gaps_s"]:
            t += gap
            xs.append(t)
            ys.append(gap * 1000)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.scatter(xs, ys, s=4, alpha=0.5)
    ax.set_title(f"Gaps between tokens over time ({run['label']})", fontsize=10)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("gap (ms)")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _slo(metrics: dict) -> str:
    """``"TTFT 10000 ms, TBT 500 ms"``: the SLOs a run was judged by."""
    return ", ".join(f"{name} {metrics[key]:g} ms" for name, key in (("TTFT", "slo_ttft_ms"), ("TBT", "slo_tbt_ms"))
                     if metrics[key] is not None) or "none set"


def plot_goodput(runs: list[dict], path: Path) -> Path:
    """Goodput and throughput (requests/s) against the offered request rate, one point per run."""
    plt = _pyplot()
    rates = [run["request_rate"] for run in runs]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(rates, [run["metrics"]["request_throughput"] for run in runs], "o--", label="throughput")
    ax.plot(rates, [run["metrics"]["goodput"] for run in runs], "o-", label="goodput (met both SLOs)")
    ax.plot(rates, rates, ":", color="grey", label="offered rate")
    ax.set_title(f"Goodput vs request rate (SLO: {_slo(runs[0]['metrics'])})", fontsize=10)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_compare(series: dict[str, list[dict]], path: Path) -> Path:
    """Designs side by side over a sweep of rates: goodput, Mooncake TBT p99 and TTFT p99, a line
    per design (``series`` maps a design's name to its runs, one per rate)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    panels = [("goodput (requests/s meeting both SLOs)", lambda m: m["goodput"]),
              ("TBT p99, Mooncake's definition (ms, log)", lambda m: m["tbt_mooncake_ms"]["p99"]),
              ("TTFT p99 (ms, log)", lambda m: m["ttft_ms"]["p99"])]
    for ax, (title, value) in zip(axes, panels):
        for name, runs in series.items():
            points = [(run["request_rate"], value(run["metrics"])) for run in runs]
            points = [(x, y) for x, y in points if isinstance(x, (int, float)) and y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=name)
        if "log" in title:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    slo = _slo(next(iter(series.values()))[0]["metrics"])
    fig.suptitle(f"Designs compared at equal request rates (SLO: {slo})", fontsize=11)
    return _save(plt, fig, path)


def write_all(runs: list[dict], directory: Path) -> list[Path]:
    """Every plot for ``runs`` into ``directory``; goodput vs rate only for a sweep of rates."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [plot_cdfs(runs, directory / "latency_cdf.png")]
    for i, run in enumerate(runs):
        slug = "".join(c if c.isalnum() or c in ".-" else "-" for c in run["label"].replace("=", ""))
        name = "tbt_over_time.png" if len(runs) == 1 else f"tbt_over_time_{i}_{slug}.png"
        paths.append(plot_tbt_over_time(run, directory / name))
    finite = [run for run in runs if isinstance(run["request_rate"], (int, float))]  # not "inf"
    if len(finite) > 1:
        paths.append(plot_goodput(finite, directory / "goodput_vs_rate.png"))
    return paths
