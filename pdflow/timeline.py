"""A request's timeline: how much of the KV transfer hid behind prefill, as figures, a
Chrome/Perfetto trace and a picture.

Timelines come from ``GET /debug/timeline/{request_id}``: ``time.monotonic()`` seconds recorded
in several processes of one host (one clock), under these keys:

- ``prefill.start`` / ``prefill.end``; ``prefill.layer_done[l]``: layer *l*'s KV computed;
- ``prefill.queued``: the request reached prefill; ``prefill.dequeued``: prefill got to it;
  ``prefill.plan_in``: its store plan was there (later than ``dequeued`` when prefill waited for
  the store, e.g. for a prefix read from disk that the queue did not hide);
- ``prefill.prefix_in[l]``: layer *l* of the cached prefix landed in prefill's buffer (a prefix
  from the store, over the data plane; absent where prefill computes in the store's arena);
- ``prefill.send_start``: the first KV write began (after the whole prefill with
  ``kv_streaming = "request"``);
- ``prefill.layer_sent[l]``: layer *l*'s keys and values handed to the data plane (the write
  returned);
- ``decode.layer_in[l]``: layer *l* landed in decode's memory (through kv-shuttle);
- ``decode.joined``, ``decode.steps`` (one per generated token), ``decode.end``;
- the colocated worker's: ``worker.queued``, ``prefill.start`` / ``prefill.end``, ``decode.steps``,
  ``decode.end``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from pdflow import client_key


def _transfer_starts(timeline: dict[str, list[float]]) -> list[float]:
    """When each layer's transfer could begin: computed, sending begun, and the layer before landed."""
    done, landed = timeline["prefill.layer_done"], timeline["decode.layer_in"]
    send_start = timeline.get("prefill.send_start", done[:1])[0]
    return [max(done[i], send_start, landed[i - 1] if i else 0.0) for i in range(len(landed))]


def kv_summary(timeline: dict[str, list[float]]) -> dict[str, float]:
    """The KV tail (prefill's last layer computed -> decode holds all KV) against the transfer.

    A layer's own transfer time runs from when it could start (computed, and the layer before it
    landed) to when it landed; the whole transfer is their sum, what a transfer that overlapped
    nothing would take. ``hidden`` is the fraction of it that overlapped prefill.
    """
    done, landed = timeline["prefill.layer_done"], timeline["decode.layer_in"]
    per_layer = [end - start for start, end in zip(_transfer_starts(timeline), landed)]
    whole = sum(per_layer)
    tail = max(landed) - done[-1]
    one = statistics.median(per_layer)
    return {
        "layers": len(done),
        "prefill_s": done[-1] - timeline["prefill.start"][0],
        "kv_tail_s": tail,
        "one_layer_transfer_s": one,
        "whole_transfer_s": whole,
        "tail_over_one_layer": tail / one if one > 0 else float("nan"),
        "hidden_fraction": 1.0 - tail / whole if whole > 0 else float("nan"),
    }


def _span(timeline: dict[str, list[float]], start: str, end: str) -> float | None:
    first, last = timeline.get(start), timeline.get(end)
    return max(last[-1] - first[0], 0.0) if first and last else None


def request_phases(timeline: dict[str, list[float]], one_clock: bool) -> dict[str, float]:
    """A finished request's phases in seconds, for the metrics: ``queue`` (waiting for prefill),
    ``prefill``, ``decode`` (joining decode's batch to the last token); and where prefill and
    decode read one clock (``one_clock``: the same machine), ``kv_transfer`` (the first KV write
    began -> decode held every layer) and ``kv_tail`` (prefill's last layer computed -> decode
    held every layer). A phase the timeline has no marks for is left out."""
    colocated = "worker.queued" in timeline
    spans = {
        "queue": _span(timeline, "worker.queued", "prefill.start") if colocated
        else _span(timeline, "prefill.queued", "prefill.dequeued"),
        "prefill": _span(timeline, "prefill.start", "prefill.end"),
        "decode": _span(timeline, "prefill.end", "decode.end") if colocated
        else _span(timeline, "decode.joined", "decode.end"),
    }
    landed = timeline.get("decode.layer_in")
    if one_clock and landed:
        marks = {**timeline, "decode.held": [max(landed)],
                 "prefill.last_layer_done": timeline.get("prefill.layer_done", [])[-1:]}
        spans["kv_transfer"] = _span(marks, "prefill.send_start", "decode.held")
        spans["kv_tail"] = _span(marks, "prefill.last_layer_done", "decode.held")
    return {name: value for name, value in spans.items() if value is not None}


LANES = ("compute", "KV transfer", "decode steps")


def chrome_trace(timeline: dict[str, list[float]], request_id: str = "request") -> dict:
    """Chrome/Perfetto trace JSON (load it in ui.perfetto.dev or chrome://tracing): prefill's
    layers on one lane, each layer's KV transfer (prefill -> kv-shuttle -> decode) on the next,
    decode's steps on the last."""
    t0 = timeline["prefill.start"][0]
    events: list[dict] = []

    def span(name: str, pid: str, tid: str, start: float, end: float, **args) -> None:
        events.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": (start - t0) * 1e6,
                       "dur": max(end - start, 0.0) * 1e6, "args": {"request_id": request_id, **args}})

    done = timeline.get("prefill.layer_done", [])
    landed = timeline.get("decode.layer_in", [])
    previous = t0
    for layer, finished in enumerate(done):
        span(f"layer {layer}", "prefill", "compute", previous, finished, layer=layer)
        previous = finished
    if landed:
        for layer, (start, end) in enumerate(zip(_transfer_starts(timeline), landed)):
            span(f"KV layer {layer}", "data plane", "KV transfer", start, end, layer=layer)
    steps = timeline.get("decode.steps", [])
    step_start = timeline.get("decode.joined", [landed[-1] if landed else previous])[0]
    for i, at in enumerate(steps):
        span(f"token {i + 1}", "decode", "decode steps", step_start, at, token=i + 1)
        step_start = at
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(timeline: dict[str, list[float]], path: str | Path, title: str = "") -> Path:
    """A PNG with prefill's layers on one lane and the KV transfers on the lanes below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = chrome_trace(timeline)["traceEvents"]
    colors = {"compute": "tab:blue", "KV transfer": "tab:orange", "decode steps": "tab:purple"}
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for event in trace:
        row = LANES.index(event["tid"])
        ax.broken_barh([(event["ts"] / 1e3, event["dur"] / 1e3)], (row - 0.4, 0.8),
                       facecolors=colors[event["tid"]], edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(LANES)), ["prefill: layers", "KV transfer", "decode: steps"])
    ax.invert_yaxis()
    ax.set_xlabel("ms since prefill started")
    summary = kv_summary(timeline) if timeline.get("decode.layer_in") else None
    if summary:
        title += (f"  KV tail {summary['kv_tail_s'] * 1e3:.1f} ms, whole transfer "
                  f"{summary['whole_transfer_s'] * 1e3:.1f} ms, {summary['hidden_fraction']:.0%} hidden")
    ax.set_title(title.strip(), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cli_trace(args) -> int:
    """``pdflow trace``: fetch or read a timeline, print its KV summary, write trace (and PNG)."""
    if args.from_file:
        timeline = json.loads(Path(args.from_file).read_text())
    else:
        import httpx

        try:
            response = httpx.get(f"{args.url.rstrip('/')}/debug/timeline/{args.request_id}", timeout=30,
                                 headers=client_key.headers(client_key.api_key(args)))
        except httpx.HTTPError as exc:
            sys.stderr.write(f"error: cannot reach {args.url}: {exc}\n")
            return 1
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            sys.stderr.write(f"error: {args.url} answered {response.status_code}: {message}\n")
            return 1
        timeline = response.json()
    output = Path(args.output or f"trace-{args.request_id}.json")
    output.write_text(json.dumps(chrome_trace(timeline, args.request_id)))
    if timeline.get("decode.layer_in"):
        summary = kv_summary(timeline)
        sys.stdout.write(
            f"{summary['layers']} layers, prefill {summary['prefill_s'] * 1e3:.1f} ms\n"
            f"KV tail {summary['kv_tail_s'] * 1e3:.2f} ms = {summary['tail_over_one_layer']:.2f}x one layer's "
            f"transfer ({summary['one_layer_transfer_s'] * 1e3:.2f} ms); whole transfer "
            f"{summary['whole_transfer_s'] * 1e3:.2f} ms, {summary['hidden_fraction']:.0%} of it hidden "
            "behind prefill\n"
        )
    else:
        sys.stdout.write("no KV transfer in this timeline (colocated, or the request ended at prefill)\n")
    sys.stdout.write(f"trace: {output} (open in ui.perfetto.dev or chrome://tracing)\n")
    if args.png:
        sys.stdout.write(f"picture: {plot(timeline, args.png, args.request_id)}\n")
    return 0
