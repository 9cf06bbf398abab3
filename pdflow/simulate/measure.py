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
beyond the bare decode step, as ``pipeline.prefill_overhead_s`` and ``decode_overhead_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--model", default="smollm2",
                   help="a known model or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--weights", default="int4-a16", help="weight format (default: %(default)s, the topology's)")
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


def tcp_gbit_per_s(chunk: int = 4 << 20, count: int = 64) -> float:
    """The tcp transport's speed between two of its endpoints here, decimal Gbit/s."""
    from pdflow.kv.checksum import checksum
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
    if args.pipeline:
        del loaded
        progress.write("the stages' overhead, through a real pipeline ...\n")
        profile["pipeline"] = pipeline_overheads(profile, args.pipeline_lengths, progress)
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
    return {"prefill_overhead_s": max(0.0, statistics.median(ttft_extra)),
            "decode_overhead_s": max(0.0, statistics.median(gap_extra)),
            "measured": f"{len(ttft_extra)} requests of {', '.join(map(str, lengths))} tokens, one at a time"}


def _times(pdflow_times, loaded, args, context: int, prefill: dict[int, float]) -> dict:
    """Decode at ``context``; prefill too, the first time."""
    times = pdflow_times(loaded, args.batch, [] if prefill else args.prefill, context, args.steps)
    prefill.update(times["prefill"])
    return times
