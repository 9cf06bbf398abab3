#!/usr/bin/env python3
"""Device memory on the data plane, measured against torch's own device-to-device copy.

For each size: torch's ``copy_`` between two device buffers (the bar a direct same-host path has
to reach: >= 0.8x), and the staged path every host-memory transport takes today (device -> pinned
host buffer -> device, through :class:`pdflow.transports.staging.Stager`, off the event loop),
in GB/s of payload and as a ratio to the copy, from the same run. The transport's own host-to-host
leg is not in the staged figure: ``pdflow bench transfer`` measures it.

    python scripts/device_bench.py                      # on a GPU (scripts/device_check.sh)
    python scripts/device_bench.py --device cpu         # the script's own dry run, anywhere
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdflow.transports.staging import Stager, StagingPool  # noqa: E402

MIB = 1 << 20
SIZES = (1536 * 1024, 16 * MIB, 256 * MIB)  # one SmolLM2 layer's KV of 1K tokens (fp32), then larger


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def torch_copy_s(size: int, device: str, repeat: int) -> float:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    assert torch.equal(dst, src)
    return min(times[1:])


async def staged_s(size: int, device: str, repeat: int) -> tuple[float, float]:
    """(best seconds of device -> host, of host -> device) through the stager."""
    stager = Stager(StagingPool(max(size, 64 * MIB)))
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    back = torch.empty_like(src)
    out, into = [], []
    try:
        for _ in range(repeat + 1):
            _sync(device)
            start = time.perf_counter()
            async with stager.to_host([src]) as (host,):
                middle = time.perf_counter()
                if host is src:  # on the CPU dry run nothing is staged: copy once, as a device would
                    host = src.clone()
                    middle = time.perf_counter()
                await stager.to_device([(back, host)])
                end = time.perf_counter()
            out.append(middle - start)
            into.append(end - middle)
        assert torch.equal(back, src)
    finally:
        stager.close()
    return min(out[1:]), min(into[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="the device whose memory is measured (default cuda:0)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per figure; the best is kept")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here; --device cpu runs the script's own dry run", file=sys.stderr)
        return 2
    rows = []
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}, best of {args.repeat}")
    print(f"{'size':>10} {'torch d2d GB/s':>15} {'staged d2h GB/s':>16} {'staged h2d GB/s':>16} "
          f"{'staged round trip GB/s':>23} {'ratio to d2d':>13}")
    for size in SIZES:
        copy = torch_copy_s(size, args.device, args.repeat)
        out, into = asyncio.run(staged_s(size, args.device, args.repeat))
        row = {"bytes": size, "torch_copy_gbps": size / copy / 1e9, "staged_d2h_gbps": size / out / 1e9,
               "staged_h2d_gbps": size / into / 1e9, "staged_gbps": size / (out + into) / 1e9}
        row["staged_ratio"] = row["staged_gbps"] / row["torch_copy_gbps"]
        rows.append(row)
        print(f"{size / MIB:>8.1f}Mi {row['torch_copy_gbps']:>15.1f} {row['staged_d2h_gbps']:>16.1f} "
              f"{row['staged_h2d_gbps']:>16.1f} {row['staged_gbps']:>23.1f} {row['staged_ratio']:>12.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"median staged ratio {statistics.median(r['staged_ratio'] for r in rows):.3f}x "
          "(a direct same-host path must reach 0.8x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
