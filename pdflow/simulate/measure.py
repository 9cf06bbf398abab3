"""``pdflow profile``: measure this machine's stage costs into a simulator profile.

    pdflow profile --out profiles/this-machine.json

It loads the model as a stage does (``--weights``, the topology's default format) with
``--threads`` torch threads (1: the default topology pins prefill and decode to a core each),
and times, with pdflow's own engine (:func:`pdflow.bench.engine.pdflow_times`): a prompt's
prefill at each ``--prefill`` length, and a decode step at each ``--batch`` size for sequences of
each ``--context`` length (the medians of ``--steps`` steps). The link is the tcp transport
moving 4 MiB chunks between two of its own endpoints on this machine (loopback), or
``--link-gbit`` as given. KV bytes per token come from the model's shape and the stages' KV dtype.

``--pipeline`` also measures what the stages add to the bare engine: it starts a real PD pipeline
(the default topology: prefill on core 0, decode on core 1), sends it one request at a time
(``--pipeline-lengths`` prompt tokens, 64 out) with ``pdflow bench serve``, and takes the median
TTFT beyond what the profile alone predicts for that request, and the median gap between tokens
beyond the bare decode step, as ``pipeline.prefill_overhead_s`` and ``decode_overhead_s``. Then,
in the same pipeline, one long answer streams while prompts of those lengths come in one after
another with pauses between them: the percentiles of its gaps over the profile's step, while a
prompt prefills (``busy``) and while none does (``idle``), are ``pipeline.decode_gap_ratios``.

``--worker`` measures the colocated worker (profile it with ``--threads 2``, as it runs): a real
colocated server streams one long answer while prompts of ``--worker-lengths`` tokens come in
one after another, and the percentiles of the answer's gap that holds a prompt's prefill over
what the profile predicts for it (the prefill and a step) are ``pipeline.worker_ratios``; then
``--worker-batches`` answers at a time stream with nothing else coming in, and the percentiles of
the seconds a step takes beyond the profile's step at that batch are
``pipeline.worker_step_extra_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import sys
import time
from pathlib import Path

from pdflow.plugins import DEFAULT_WEIGHTS

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--model", default="smollm2",
                   help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS, help="weight format (default: %(default)s, the topology's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--prefill", type=int, nargs="+", default=[64, 256, 1024, 2048],
                   help="prefill lengths (default: 64 256 1024 2048)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32],
                   help="decode batch sizes (default: 1 4 16 32)")
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024], help="decode contexts (default: 128 1024)")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per point (default: %(default)s)")
    p.add_argument("--link-gbit", type=float, default=None, help="the link's speed instead of measuring tcp")
    p.add_argument("--max-batch", type=int, default=32, help="decode's limits.max_batch (default: %(default)s)")
    p.add_argument("--replica-start-s", type=float, default=1.0,
                   help="a scaled replica's time to ready (default: %(default)s; docs/benchmarks.md, Scaler)")
    p.add_argument("--pipeline", action="store_true",
                   help="also measure the stages' own overhead through a real pipeline (a minute more)")
    p.add_argument("--pipeline-lengths", type=int, nargs="+", default=[128, 512, 1024],
                   help="prompt lengths sent through it (default: 128 512 1024)")
    p.add_argument("--worker", action="store_true",
                   help="also measure the colocated worker's iterations through a real colocated server (a minute more)")
    p.add_argument("--worker-lengths", type=int, nargs="+", default=[128, 256, 384, 512, 640, 768, 896, 1024],
                   help="prompt lengths sent to it (default: 128 to 1024 in steps of 128)")
    p.add_argument("--worker-batches", type=int, nargs="+", default=[1, 4, 16],
                   help="batch sizes its step alone is measured at (default: 1 4 16)")


def tcp_gbit_per_s(chunk: int = 4 << 20, count: int = 64) -> float:
    """The tcp transport's speed between two of its endpoints here, decimal Gbit/s."""
    from pdflow.transports.checksum import checksum
    from pdflow.messages import KvChunkHeader
    from pdflow.transports import create

    async def measure() -> float:
        async with create("tcp") as receiver, create("tcp") as sender:
            await receiver.start()
            receiver.allocate(1, chunk)
            data = bytes(chunk)
            header = KvChunkHeader("profile", 0, -1, 0, 0, "uint8", (chunk,), 1, 0, chunk, checksum(data))
            await sender.write(receiver.address, header, data)  # connect, warm up
            await receiver.next_notice()
            started = time.perf_counter()
            for _ in range(count):
                await sender.write(receiver.address, header, data)
                await receiver.next_notice()
            return chunk * count * 8 / (time.perf_counter() - started) / 1e9

    return asyncio.run(measure())


def main(args: argparse.Namespace, progress=None) -> int:
    import torch

    progress = progress or sys.stderr  # (looked up now: a default bound at import can be a closed stream)
    from pdflow.bench.engine import pdflow_times
    from pdflow.engine import load_model
    from pdflow.models import ModelError, resolve

    torch.set_num_threads(args.threads)
    try:
        model_dir = resolve(args.model, progress=False)
        progress.write(f"loading {args.model} ({args.weights}) ...\n")
        loaded = load_model(model_dir, weights=args.weights)
    except (ModelError, ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    prefill: dict[int, float] = {}
    decode: list[list[float]] = []
    for context in args.context:
        progress.write(f"decode steps over {context}-token sequences, batches {args.batch} ...\n")
        times = _times(pdflow_times, loaded, args, context, prefill)
        decode.append([times["decode"][b] for b in args.batch])
    link = args.link_gbit
    if link is None:
        progress.write("the tcp transport on loopback ...\n")
        link = tcp_gbit_per_s()
    layout = loaded.layout
    profile = {
        "name": f"{args.model}-{args.weights}-{args.threads}t-{platform.node() or 'this-machine'}",
        "source": f"pdflow profile on {platform.processor() or platform.machine()}, {args.threads} torch "
                  f"thread(s), {time.strftime('%Y-%m-%d')}; link: "
                  + ("as given" if args.link_gbit is not None else "tcp transport on loopback, measured"),
        "layers": layout.num_layers, "kv_bytes_per_token": layout.request_bytes(1),
        "prefill": {"tokens": sorted(prefill), "seconds": [prefill[n] for n in sorted(prefill)]},
        "decode": {"batch": list(args.batch), "context": list(args.context), "seconds": decode},
        "link": {"gbit_per_s": round(link, 2), "latency_s": 0.0}, "fetch_gbit_per_s": round(link, 2),
        "replica_start_s": args.replica_start_s, "max_batch": args.max_batch,
    }
    if args.pipeline or args.worker:
        del loaded
    if args.pipeline:
        progress.write("the stages' overhead, through a real pipeline ...\n")
        profile["pipeline"] = pipeline_overheads(profile, args.pipeline_lengths, progress)
    if args.worker:
        progress.write("the colocated worker's iterations, through a real colocated server ...\n")
        profile.setdefault("pipeline", {}).update(worker_costs(profile, args.worker_lengths, args.worker_batches,
                                                               progress))
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    progress.write(f"wrote {args.out}\n")
    return 0


def pipeline_overheads(profile: dict, lengths: list[int], progress, output: int = 64) -> dict:
    """``prefill_overhead_s`` and ``decode_overhead_s``: one request at a time through a real PD
    pipeline, against what ``profile`` (without overheads) predicts for each."""
    import statistics
    import tempfile

    from pdflow.bench.experiments import bench
    from pdflow.simulate.cluster import Deployment
    from pdflow.simulate.profile import Profile
    from pdflow.simulate.run import simulate
    from pdflow.simulate.workload import SimRequest
    from pdflow.testing.server import PdflowServer

    bare = Profile.from_dict({**profile, "pipeline": {}})
    ttft_extra, gap_extra = [], []
    with tempfile.TemporaryDirectory() as tmp, PdflowServer(Path(tmp)) as server:
        for n in lengths:
            result = bench(server.url, Path(tmp) / f"pipeline-{n}.json",
                           ["--dataset", "fixed", "--input-len", str(n), "--output-len", str(output),
                            "--num-prompts", "4", "--max-concurrency", "1", "--seed", str(n)])
            for record in result["runs"][0]["records"]:
                if record.get("error") or record["ttft_s"] is None:
                    continue
                tokens = record.get("usage_prompt_tokens") or n
                alone = SimRequest(0, 0.0, tokens, record["output_tokens"], [10**12 + k for k in range(tokens)])
                simulate([alone], bare, Deployment(1, 1, block_tokens=1))
                ttft_extra.append(record["ttft_s"] - alone.first_token_s)
                gap_extra += [gap - step for gap, step in zip(record["gaps_s"], alone.gaps)]
            progress.write(f"  {n} tokens: TTFT beyond the engine {statistics.median(ttft_extra) * 1e3:.0f} ms, "
                           f"a step beyond it {statistics.median(gap_extra) * 1e3:.2f} ms\n")
        overheads = {"prefill_overhead_s": max(0.0, statistics.median(ttft_extra)),
                     "decode_overhead_s": max(0.0, statistics.median(gap_extra))}
        staged = Profile.from_dict({**profile, "pipeline": overheads})
        progress.write("  an answer's gaps while prompts come in ...\n")
        busy, idle = asyncio.run(gaps_beside_prefills(server.url, staged, lengths))
    ratios = {"busy": percentiles(busy), "idle": percentiles(idle)}
    progress.write(f"  gap / step: beside a prefill p50 {ratios['busy'][50]:.2f}, p99 {ratios['busy'][99]:.2f} "
                   f"({len(busy)} gaps); alone p50 {ratios['idle'][50]:.2f}, p99 {ratios['idle'][99]:.2f} "
                   f"({len(idle)} gaps)\n")
    return {**overheads, "decode_gap_ratios": ratios,
            "measured": f"{len(ttft_extra)} requests of {', '.join(map(str, lengths))} tokens, one at a time; "
                        f"gap ratios over {len(busy)} gaps beside a prefill and {len(idle)} without"}


def percentiles(xs: list[float]) -> list[float]:
    """The 0th, 1st, ..., 100th percentiles of ``xs`` (at least two values)."""
    import statistics

    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    return [round(x, 4) for x in (min(xs), *cuts, max(xs))]


async def gaps_beside_prefills(url: str, profile, lengths: list[int], rounds: int = 3, prompt: int = 128,
                               pause_s: float = 1.0, first_id: int = 1000) -> tuple[list[float], list[float]]:
    """One answer at a time streams while prompts of ``lengths`` tokens are sent one after another
    (one token each, ``pause_s`` apart, ids no other prompt shares: nothing cached); each of its
    gaps over ``profile``'s step at batch 1 and its context, split by whether a prompt was
    prefilling then (sent, not yet answered) or not. The answer's first gap (its KV's arrival) is
    left out; gaps are between chunks with text, as ``pdflow bench serve`` takes them."""
    import httpx

    busy: list[float] = []
    idle: list[float] = []
    ids = _fresh_ids(first_id)

    expected = pause_s + sum(profile.prefill_s(n) + pause_s for n in lengths) + pause_s
    tokens = int(expected / profile.decode_step_s(1, prompt + 256)) + 32
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            answer = asyncio.ensure_future(_stream(client, url, ids(prompt), tokens))
            windows = []
            await asyncio.sleep(pause_s)
            for n in lengths:
                sent = time.monotonic()
                first = await _stream(client, url, ids(n), 1)
                windows.append((sent, first[0]))
                await asyncio.sleep(pause_s)
            times = await answer
            for i in range(2, len(times)):
                start, end = times[i - 1], times[i]
                ratio = (end - start) / profile.decode_step_s(1, prompt + i)
                (busy if any(a < end and b > start for a, b in windows) else idle).append(ratio)
    return busy, idle


def worker_costs(profile: dict, lengths: list[int], batches: list[int], progress) -> dict:
    """``pipeline.worker_ratios`` (:func:`worker_iterations`) and ``worker_step_extra_s``
    (:func:`worker_steps`) through a real colocated server (pdflow's colocated topology, the
    worker on both cores), against ``profile``'s costs."""
    import statistics
    import tempfile

    from pdflow.simulate.profile import Profile
    from pdflow.testing.server import PdflowServer

    bare = Profile.from_dict({**profile, "pipeline": {}})
    with tempfile.TemporaryDirectory() as tmp, PdflowServer(Path(tmp), mode="colocated") as server:
        prefill, decode = asyncio.run(worker_iterations(server.url, bare, lengths))
        if len(prefill) < 2:
            raise RuntimeError(f"the worker's iterations: {len(prefill)} prefills found in the answer's gaps (at "
                               "least two are needed; give more --worker-lengths)")
        ratios = {"prefill": percentiles(prefill)}
        progress.write(f"  an iteration that prefills over its prediction: p50 {ratios['prefill'][50]:.2f}, p90 "
                       f"{ratios['prefill'][90]:.2f} ({len(prefill)} prompts)"
                       + (f"; a step beside them p50 {statistics.median(decode):.2f} of the bare step\n"
                          if decode else "\n"))
        extras, first_id = {}, 25_000  # (past worker_iterations' ids: no prompt shares a cached prefix)
        for batch in batches:
            extra = asyncio.run(worker_steps(server.url, bare, batch, first_id=first_id))
            first_id += 4 * 128 * batch  # (the ids worker_steps takes, and more)
            if len(extra) < 2:
                raise RuntimeError(f"the worker's steps at batch {batch}: {len(extra)} gaps while all {batch} answers "
                                   "ran (at least two are needed)")
            extras[str(batch)] = percentiles(extra)
            progress.write(f"  a step alone at batch {batch}: {bare.decode_step_s(batch, 192) * 1e3:.1f} ms bare, "
                           f"+{statistics.median(extra) * 1e3:.2f} ms p50, +{extras[str(batch)][99] * 1e3:.2f} ms "
                           f"p99 ({len(extra)} steps)\n")
    return {"worker_ratios": ratios, "worker_step_extra_s": extras}


async def worker_steps(url: str, profile, batch: int, tokens: int = 160, prompt: int = 128, rounds: int = 2,
                       first_id: int = 25_000) -> list[float]:
    """Through a colocated worker at ``url``: ``batch`` answers at a time stream together, nothing
    else coming in. Returns the seconds each of the first answer's gaps took beyond ``profile``'s
    step at ``batch`` and its context, over the gaps while every answer was running (after the
    last one's first token, up to the first one's last), the first answer's own first gap left
    out."""
    import httpx

    extra: list[float] = []
    ids = _fresh_ids(first_id)
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            streams = await asyncio.gather(*(_stream(client, url, ids(prompt), tokens) for _ in range(batch)))
            if not all(streams):
                continue
            start, end = max(times[0] for times in streams), min(times[-1] for times in streams)
            times = streams[0]
            for i in range(2, len(times)):
                if times[i - 1] >= start and times[i] <= end:
                    extra.append(times[i] - times[i - 1] - profile.decode_step_s(batch, prompt + i))
    return extra


async def worker_iterations(url: str, profile, lengths: list[int], rounds: int = 4, prompt: int = 128,
                            pause_s: float = 0.5, first_id: int = 5000) -> tuple[list[float], list[float]]:
    """Through a colocated worker at ``url``: one answer at a time streams while prompts of
    ``lengths`` tokens are sent one after another (one token each, ``pause_s`` apart, nothing
    cached). The worker prefills a prompt between two of the answer's steps, so one of the
    answer's gaps holds it: the longest of those from the prompt's sending to its first token
    (a prefill is many steps long). The answer is cut a pause after the last prompt. Returns that
    gap over ``profile``'s prefill of the prompt and a step at batch 1, for every prompt, and
    each other gap over the step (the answer's first gap, which holds its own prefill, left out)."""
    import httpx

    prefill: list[float] = []
    decode: list[float] = []
    ids = _fresh_ids(first_id)
    expected = pause_s + sum(profile.prefill_s(n) + profile.decode_step_s(1, prompt) + pause_s for n in lengths)
    tokens = 2 * int(expected / profile.decode_step_s(1, prompt)) + 32  # more than it will have time for
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            times: list[float] = []
            answer = asyncio.ensure_future(_stream(client, url, ids(prompt), tokens, times))
            windows = []
            await asyncio.sleep(pause_s)
            for n in lengths:
                sent = time.monotonic()
                first = await _stream(client, url, ids(n), 1)
                if first:  # (a token that ends mid-character has no text)
                    windows.append((n, sent, first[0]))
                await asyncio.sleep(pause_s)
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            held = {}
            for n, sent, at in windows:
                inside = [k for k in range(2, len(times)) if times[k] > sent and times[k - 1] < at]
                if inside:
                    held[max(inside, key=lambda k: times[k] - times[k - 1])] = n
            for i in range(2, len(times)):
                gap, step = times[i] - times[i - 1], profile.decode_step_s(1, prompt + i)
                if i in held:
                    prefill.append(gap / (profile.prefill_s(held[i]) + step))
                else:
                    decode.append(gap / step)
    return prefill, decode


def _fresh_ids(first_id: int):
    """Prompts of token ids no other prompt of this measurement shares (nothing cached)."""
    fresh = itertools.count(first_id)
    return lambda n: [next(fresh) % 40000 + 1000 for _ in range(n)]


async def _stream(client, url: str, prompt_ids: list[int], max_tokens: int,
                  times: list[float] | None = None) -> list[float]:
    """A greedy completion streamed from ``url``: when each chunk with text came (as ``pdflow
    bench serve`` times them), appended to ``times`` as they come (so a cancelled stream leaves
    what it had)."""
    body = {"model": "smollm2", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = [] if times is None else times
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                choices = json.loads(line[5:]).get("choices") or []
                if any(choice.get("text") for choice in choices):
                    times.append(time.monotonic())
    return times


def _times(pdflow_times, loaded, args, context: int, prefill: dict[int, float]) -> dict:
    """Decode at ``context``; prefill too, the first time."""
    times = pdflow_times(loaded, args.batch, [] if prefill else args.prefill, context, args.steps)
    prefill.update(times["prefill"])
    return times
