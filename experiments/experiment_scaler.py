#!/usr/bin/env python
"""The adaptive scaler on a load step, against fixed prefill:decode splits of the same replicas.

A load step: Poisson arrivals at ``--rate`` for ``--before`` seconds, ×``--step`` for
``--during`` seconds, back to ``--rate`` for ``--after`` seconds. Each request is a distinct
prompt (no prefix shared: the store does not help) streamed with the official client, its TTFT
and mean time between tokens kept. Run once per deployment:

- ``scaled``: prefill and decode each between 1 and ``--most`` replicas, the scaler deciding;
- ``fixed P:D``: the fixed splits ``--splits`` lists (default 1:3, 2:2, 3:1: four replicas
  running all along, as many as the scaled run has with two of each).

Reported: SLO attainment (TTFT and TBT both within ``--slo-ttft-ms`` / ``--slo-tbt-ms``) over the
whole run and during the step, TTFT and TBT p50/p99, and for the scaled run its replicas over
time; a PNG (``--plot``): replicas, TTFT and TBT over time for the scaled run.

Prefill replicas share core 0 and decode replicas core 1, as the default topology's one of each
do: on this 2-core machine more replicas add concurrency, not compute.

    .venv/bin/python experiments/experiment_scaler.py --out bench-results/scaler --plot
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import httpx
import openai

from pdflow.bench.experiments import Report, experiment_parser, figure, serving
from pdflow.testing.server import replicated_ports, replicated_topology

REPORT = Report()
say = REPORT.say
WORDS = ("river stone lamp orbit cedar violet harbor signal meadow copper lantern glacier whisper "
         "canyon ember falcon tundra quartz monsoon saddle").split()


def topology(prefill: tuple[int, int], decode: tuple[int, int], opts):
    """``prefill`` and ``decode``: (min, max) replicas (equal: fixed)."""
    tables = f"""
[router]
policy = "least_loaded"

[scaler]
interval_s = 1.0
window_s = 10.0
ttft_slo_ms = {opts.slo_ttft_ms}
tbt_slo_ms = {opts.slo_tbt_ms}
prefill_queue_per_replica = {opts.prefill_queue}
decode_queue_per_replica = {opts.decode_queue}
up_after_s = 3.0
down_after_s = 15.0
cooldown_s = 10.0
"""
    return replicated_topology({"prefill": prefill[1], "decode": decode[1]}, tables,
                               min_replicas={"prefill": prefill[0], "decode": decode[0]},
                               limits={"request_timeout_s": 300, "max_queued_requests": 1024})


def prompt(rng: random.Random, words: int) -> str:
    return f"Request {rng.randrange(10**9)}. Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client, text: str, max_tokens: int, sent: float, t0: float) -> dict:
    record = {"sent": sent - t0}
    try:
        stream = await client.completions.create(model="smollm2", prompt=text, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        times = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.monotonic())
        record["ttft"] = times[0] - sent
        record["tbt"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        record["done"] = times[-1] - t0
    except Exception as exc:  # noqa: BLE001 — a failed request is a result too
        record["error"] = repr(exc)[:200]
    return record


async def load(url: str, opts) -> list[dict]:
    rng = random.Random(opts.seed)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.monotonic()
    phases = [(opts.before, opts.rate), (opts.during, opts.rate * opts.step), (opts.after, opts.rate)]
    tasks, at = [], 0.0
    for length, rate in phases:
        end = at + length
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                at = end
                break
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(client, prompt(rng, opts.prompt_words), opts.max_tokens,
                                                   time.monotonic(), t0)))
    records = list(await asyncio.gather(*tasks))
    await client.close()
    return records


def watch(url: str, t0: float, stop: threading.Event, samples: list) -> None:
    """Every second: how many replicas of prefill and decode are ready (and in which states)."""
    while not stop.is_set():
        try:
            stages = httpx.get(f"{url}/health", timeout=5).json()["stages"]
            row = {"t": time.monotonic() - t0}
            for stage in ("prefill", "decode"):
                states = [s["state"] for name, s in stages.items() if name.rsplit("-", 1)[0] == stage]
                row[stage] = sum(s in ("ready", "draining") for s in states)
                row[f"{stage}_states"] = states
            samples.append(row)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        stop.wait(1.0)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(name: str, records: list[dict], opts) -> dict:
    ok = [r for r in records if "error" not in r]
    met = [r for r in ok if r["ttft"] * 1e3 <= opts.slo_ttft_ms and r["tbt"] * 1e3 <= opts.slo_tbt_ms]
    lo, hi = opts.before, opts.before + opts.during
    step = [r for r in records if lo <= r["sent"] < hi]
    step_met = [r for r in met if lo <= r["sent"] < hi]
    return {"name": name, "requests": len(records), "failed": len(records) - len(ok),
            "attainment": len(met) / len(records) if records else 0.0,
            "step_attainment": len(step_met) / len(step) if step else 0.0,
            "ttft_p50": pct([r["ttft"] for r in ok], 0.5), "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
            "tbt_p50": pct([r["tbt"] for r in ok], 0.5), "tbt_p99": pct([r["tbt"] for r in ok], 0.99)}


def run_one(name: str, prefill: tuple[int, int], decode: tuple[int, int], opts) -> tuple[dict, list, list, list]:
    with serving(topology=topology(prefill, decode, opts),
                 ports=replicated_ports({"prefill": prefill[1], "decode": decode[1]}), startup_timeout_s=400) as server:
        samples: list = []
        stop = threading.Event()
        t0 = time.monotonic()
        watcher = threading.Thread(target=watch, args=(server.url, t0, stop, samples), daemon=True)
        watcher.start()
        records = asyncio.run(load(server.url, opts))
        time.sleep(opts.linger)  # the scaled run: see it come back down
        stop.set()
        watcher.join()
        log = server.log_path.read_text(errors="replace")  # all of it (server.log() keeps the tail)
    events = [line for line in log.splitlines() if "scaler." in line]
    summary = summarize(name, records, opts)
    say(f"| {name} | {summary['requests']} | {summary['failed']} | {summary['attainment']:.0%} | "
        f"{summary['step_attainment']:.0%} | {figure(summary['ttft_p50'] and summary['ttft_p50'] * 1e3)} | "
        f"{figure(summary['ttft_p99'] and summary['ttft_p99'] * 1e3)} | "
        f"{figure(summary['tbt_p50'] and summary['tbt_p50'] * 1e3, '.1f')} | "
        f"{figure(summary['tbt_p99'] and summary['tbt_p99'] * 1e3, '.1f')} |")
    return summary, records, samples, events


def plot(records: list, samples: list, opts, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [s["t"] for s in samples]
    axes[0].step(t, [s["prefill"] for s in samples], where="post", label="prefill replicas")
    axes[0].step(t, [s["decode"] for s in samples], where="post", label="decode replicas")
    axes[0].set_ylabel("replicas ready")
    axes[0].legend(loc="upper right")
    ok = [r for r in records if "error" not in r]
    axes[1].scatter([r["sent"] for r in ok], [r["ttft"] * 1e3 for r in ok], s=6)
    axes[1].axhline(opts.slo_ttft_ms, color="red", linestyle="--", label="SLO")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_yscale("log")
    axes[1].legend(loc="upper right")
    axes[2].scatter([r["sent"] for r in ok], [r["tbt"] * 1e3 for r in ok], s=6)
    axes[2].axhline(opts.slo_tbt_ms, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("mean TBT (ms)")
    axes[2].set_xlabel("seconds (request sent)")
    axes[2].legend(loc="upper right")
    for ax in axes:
        ax.axvspan(opts.before, opts.before + opts.during, color="orange", alpha=0.12)
    fig.suptitle(f"Scaler on a load step: {opts.rate:g} -> {opts.rate * opts.step:g} -> {opts.rate:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = experiment_parser(__doc__, "scaler")
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second before and after the step")
    parser.add_argument("--step", type=float, default=4.0, help="the rate during the step, as a multiple")
    parser.add_argument("--before", type=float, default=30.0)
    parser.add_argument("--during", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=60.0)
    parser.add_argument("--linger", type=float, default=20.0, help="seconds watched after the last request")
    parser.add_argument("--most", type=int, default=3, help="the scaled run's replicas of each stage at most")
    parser.add_argument("--splits", default="1:3,2:2,3:1", help="fixed prefill:decode splits to compare")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tbt-ms", type=float, default=100.0)
    parser.add_argument("--prefill-queue", type=float, default=2.0)
    parser.add_argument("--decode-queue", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", action="store_true")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    REPORT.header("Scaler on a load step")
    say(f"load: {opts.rate:g} req/s for {opts.before:g} s, {opts.rate * opts.step:g} req/s for {opts.during:g} s, "
        f"{opts.rate:g} req/s for {opts.after:g} s; {opts.prompt_words}-word prompts, {opts.max_tokens} tokens; "
        f"SLO TTFT {opts.slo_ttft_ms:g} ms, TBT {opts.slo_tbt_ms:g} ms")
    say()
    say("| deployment | requests | failed | SLO attainment | during the step | TTFT p50 ms | TTFT p99 ms | "
        "TBT p50 ms | TBT p99 ms |")
    say("|---|---|---|---|---|---|---|---|---|")
    results = {}
    summary, records, samples, events = run_one(f"scaled (1-{opts.most} each)", (1, opts.most), (1, opts.most), opts)
    results["scaled"] = {"summary": summary, "records": records, "replicas": samples, "events": events}
    for split in opts.splits.split(","):
        p, d = (int(x) for x in split.split(":"))
        summary, records, _, _ = run_one(f"fixed {p}:{d}", (p, p), (d, d), opts)
        results[f"fixed {p}:{d}"] = {"summary": summary, "records": records}
    best = max((r["summary"] for name, r in results.items() if name != "scaled"), key=lambda s: s["attainment"])
    scaled = results["scaled"]["summary"]
    say()
    say(f"scaled against the best fixed split ({best['name']}): SLO attainment {scaled['attainment']:.0%} against "
        f"{best['attainment']:.0%} ({scaled['attainment'] / best['attainment']:.2f}x)" if best["attainment"] else
        "no fixed split met the SLOs")
    peak = {stage: max(s[stage] for s in results["scaled"]["replicas"]) for stage in ("prefill", "decode")}
    say(f"scaled run: at most {peak['prefill']} prefill and {peak['decode']} decode replicas ready; "
        f"{sum('scaler.up' in e for e in events)} starts, {sum('scaler.parked' in e for e in events)} parked")
    for event in events:
        say(f"    {event.strip()[:200]}")
    (opts.out / "results.json").write_text(json.dumps(results, indent=1))
    if opts.plot:
        plot(results["scaled"]["records"], results["scaled"]["replicas"], opts, opts.out / "scaler.png")
        say(f"plot: {opts.out / 'scaler.png'}")
    REPORT.write(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
