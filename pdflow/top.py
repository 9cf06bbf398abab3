"""``pdflow top``: a live terminal view of a running pdflow, read from its ``GET /metrics``.

Every interval it scrapes the endpoint and shows what changed since the previous scrape: request
and token rates, TTFT / TBT / end-to-end percentiles of the requests in that window (from the
histograms' bucket counts, interpolated as Prometheus's ``histogram_quantile`` does), each stage's
replicas (state, requests in flight, decode batch, restarts), the KV stores (hit ratio, bytes per
tier) and the KV bytes per second each stage writes to each other stage. ``--once`` prints one
frame (two scrapes ``--interval`` apart) and exits: for scripts and logs.
"""

from __future__ import annotations

import math
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table

from pdflow import client_key


class ScrapeError(RuntimeError):
    pass


@dataclass
class Scrape:
    """One reading of /metrics: every sample by metric name and labels."""

    at: float
    samples: dict[str, dict[tuple, float]] = field(default_factory=lambda: defaultdict(dict))

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        scrape = cls(at)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                scrape.samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
        return scrape

    def value(self, metric: str, /, **labels) -> float:
        """The sum of ``metric``'s samples whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for key, v in self.samples.get(metric, {}).items() if wanted <= set(key))

    def series(self, name: str) -> dict[tuple, float]:
        return self.samples.get(name, {})


def fetch(url: str, api_key: str | None, timeout: float = 5.0) -> Scrape:
    request = urllib.request.Request(url.rstrip("/") + "/metrics",
                                     headers=client_key.headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Scrape.parse(response.read().decode(), time.monotonic())
    except urllib.error.HTTPError as exc:
        hint = " (give the API key: --api-key or PDFLOW_API_KEY)" if exc.code == 401 else ""
        raise ScrapeError(f"{url}/metrics answered {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ScrapeError(f"cannot reach {url}/metrics: {getattr(exc, 'reason', exc)}") from None


def quantile(q: float, before: Scrape | None, now: Scrape, name: str) -> float | None:
    """The ``q`` quantile of histogram ``name`` over the observations between two scrapes (since
    the start when ``before`` is None); None when there were none."""
    buckets = []
    for key, count in now.series(f"{name}_bucket").items():
        bound = float(dict(key)["le"])
        earlier = before.series(f"{name}_bucket").get(key, 0.0) if before is not None else 0.0
        buckets.append((bound, count - earlier))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # in the open bucket: its lower edge, as Prometheus does
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def _by(scrape: Scrape, name: str, *keys: str) -> dict[tuple, float]:
    """``name``'s samples keyed by the values of labels ``keys``."""
    out: dict[tuple, float] = {}
    for labels, value in scrape.series(name).items():
        d = dict(labels)
        out[tuple(d.get(k, "") for k in keys)] = value
    return out


def render(before: Scrape | None, now: Scrape, url: str) -> Group:
    span = (now.at - before.at) if before is not None else None

    def rate(name: str, **labels) -> str:
        if before is None or not span:
            return "-"
        return f"{(now.value(name, **labels) - before.value(name, **labels)) / span:,.2f}/s"

    prompt = now.value("pdflow_prompt_tokens_total")
    cached = now.value("pdflow_cached_prompt_tokens_total")
    requests = Table(title=f"pdflow at {url}", title_justify="left", show_header=True, expand=False)
    for column in ("in flight", "finished", "failed", "cancelled", "refused", "tokens out", "cached prompt"):
        requests.add_column(column, justify="right")
    requests.add_row(
        f"{now.value('pdflow_requests_in_flight'):.0f}",
        f"{now.value('pdflow_requests_total', outcome='finished'):.0f} ({rate('pdflow_requests_total', outcome='finished')})",
        f"{now.value('pdflow_requests_total', outcome='failed'):.0f}",
        f"{now.value('pdflow_requests_total', outcome='cancelled'):.0f}",
        f"{now.value('pdflow_http_refusals_total'):.0f}",
        f"{now.value('pdflow_generation_tokens_total'):.0f} ({rate('pdflow_generation_tokens_total')})",
        f"{cached / prompt:.0%} of {prompt:.0f}" if prompt else "-",
    )

    latency = Table(title="latency: last interval | since start", title_justify="left")
    latency.add_column("")
    for column in ("p50", "p90", "p99", "p50 all", "p99 all"):
        latency.add_column(column, justify="right")
    for label, name in (("TTFT", "pdflow_time_to_first_token_seconds"), ("TBT", "pdflow_time_between_tokens_seconds"),
                        ("E2E", "pdflow_e2e_request_latency_seconds")):
        latency.add_row(label, *(_ms(quantile(q, before, now, name)) if before is not None else "-"
                                 for q in (0.5, 0.9, 0.99)),
                        *(_ms(quantile(q, None, now, name)) for q in (0.5, 0.99)))

    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "replicas", "in flight", "batch", "mean batch", "restarts"):
        stages.add_column(column, justify="left" if column == "stage" else "right")
    configured = _by(now, "pdflow_replicas_configured", "stage")
    states = _by(now, "pdflow_replicas", "stage", "state")
    in_flight = _by(now, "pdflow_stage_in_flight", "stage", "replica")
    batch = _by(now, "pdflow_decode_batch_size", "stage", "replica")
    steps, rows = _by(now, "pdflow_decode_steps_total", "stage"), _by(now, "pdflow_decode_step_rows_total", "stage")
    restarts = _by(now, "pdflow_stage_restarts_total", "stage", "replica")
    for (stage,), count in configured.items():
        up = states.get((stage, "ready"), 0)
        others = ", ".join(f"{states[(stage, s)]:.0f} {s}" for s in ("starting", "restarting", "unreported")
                           if states.get((stage, s)))
        flights = [f"{v:.0f}" for (s, _), v in sorted(in_flight.items()) if s == stage]
        batches = [f"{v:.0f}" for (s, _), v in sorted(batch.items()) if s == stage]
        mean = sum(v for k, v in rows.items() if k[0] == stage) / max(sum(v for k, v in steps.items() if k[0] == stage), 1)
        stages.add_row(stage, f"{up:.0f}/{count:.0f} ready" + (f" ({others})" if others else ""),
                       " ".join(flights) or "-", " ".join(batches) or "-", f"{mean:.1f}" if batches else "-",
                       f"{sum(v for (s, _), v in restarts.items() if s == stage):.0f}")

    kv = Table(title="KV", title_justify="left")
    for column in ("replica", "hit ratio", "memory used", "disk used", "sent"):
        kv.add_column(column, justify="left" if column == "replica" else "right")
    lookups = _by(now, "pdflow_kv_store_lookups_total", "stage", "replica")
    hits = _by(now, "pdflow_kv_store_hits_total", "stage", "replica")
    ratio = {key: hits.get(key, 0.0) / count if count else 0.0 for key, count in lookups.items()}
    tiers = _by(now, "pdflow_kv_store_bytes", "stage", "replica", "tier", "kind")
    sent_now = _by(now, "pdflow_kv_sent_bytes_total", "stage", "replica", "peer")
    sent_before = _by(before, "pdflow_kv_sent_bytes_total", "stage", "replica", "peer") if before else {}
    replicas = sorted({k[:2] for k in ratio} | {k[:2] for k in sent_now})
    for stage, replica in replicas:
        def tier(name: str) -> str:
            used = tiers.get((stage, replica, name, "used"))
            total = tiers.get((stage, replica, name, "capacity"))
            return "-" if used is None else f"{_bytes(used)} / {_bytes(total or 0)}"

        links = []
        for (s, r, peer), value in sorted(sent_now.items()):
            if (s, r) == (stage, replica):
                per_s = (value - sent_before.get((s, r, peer), 0.0)) / span if span else None
                links.append(f"-> {peer} {_bytes(value)}" + (f" ({_bytes(per_s)}/s)" if per_s is not None else ""))
        hit = ratio.get((stage, replica))
        kv.add_row(f"{stage}-{replica}", "-" if hit is None else f"{hit:.0%}", tier("memory"), tier("disk"),
                   "; ".join(links) or "-")
    return Group(requests, latency, stages, *([kv] if replicas else []))


def main(args) -> int:
    api_key = client_key.api_key(args)
    console = Console()
    if args.once:
        try:
            before = fetch(args.url, api_key)
            time.sleep(args.interval)
            now = fetch(args.url, api_key)
        except ScrapeError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 1
        console.print(render(before, now, args.url))
        return 0
    from rich.live import Live

    before = None
    with Live(console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                try:
                    now = fetch(args.url, api_key)
                    live.update(render(before, now, args.url), refresh=True)
                    before = now
                except ScrapeError as exc:
                    live.update(f"[red]{exc}[/red] (retrying every {args.interval:g} s)", refresh=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0

