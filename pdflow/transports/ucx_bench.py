"""How fast the ucx transport moves chunks between two processes, beside ucxx's own send/recv.

Run ``python -m pdflow.transports.ucx_bench`` (``--help`` for the knobs). A receiver child
process takes, in turn, rounds of chunks of each size through three paths, interleaved so that
a busy machine slows them alike:

- ``ucx``: :class:`~pdflow.transports.ucx.UcxTransport` ``write()`` -> notice (header, payload
  straight into the region, checksum verified), one awaited write after another;
- ``raw``: the same UCX tagged send/recv of the payload alone on a :class:`UcxWorker`
  (no header, no checksum, no notice): the floor of what ucx adds;
- ``ucxx-api``: ucxx's public asyncio API (``create_endpoint_from_worker_address`` without
  error handling + ``Endpoint.send`` / ``ucxx.recv``) with its progress mode
  (``UCXPY_PROGRESS_MODE``, default ``thread``), in a fresh pair of processes per round so that
  its progress thread or polling task does not slow the other paths.

GB/s is 10^9 payload bytes per second from the first send to the receiver's last completion
(``time.monotonic()``, one clock for both processes), the median of the measured rounds after
one warm-up round; the ratio column is ucx / raw and ucx / ucxx-api from the same run.
The payload's checksum is computed once per size, outside the timing (the caller's job).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import time

import msgspec
import structlog

from pdflow.kv.checksum import checksum
from pdflow.messages import KvChunkHeader
from pdflow.transports.ucx import UcxTransport
from pdflow.transports.ucx_worker import UcxWorker

PATHS = ("ucx", "raw", "ucxx-api")
TAG = 7


async def _peer(max_size: int) -> None:
    """The receiver of ucx and raw rounds: prints its addresses, then serves ``path size count``
    lines from stdin, answering each with the monotonic time of the last completion."""
    receiver = UcxTransport()
    await receiver.start()
    region = receiver.allocate(1, max_size)
    worker = UcxWorker()
    print(msgspec.json.encode({"ucx": receiver.address, "raw": worker.address.hex()}).decode(), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        path, size, count = line.split()[0], *map(int, line.split()[1:])
        for _ in range(count):
            if path == "ucx":
                notice = await receiver.next_notice()
                assert notice.error is None, notice.error
            else:
                request = worker.recv(region[:size], TAG)
                await worker.completion(request)
                request.check_error()
        print(time.monotonic(), flush=True)


async def _api(role: str, size: int, count: int) -> None:
    """One ucxx-api round in a process of its own (ucxx's progress must not slow the others):
    the receiver prints its worker address, then the time of its last completion; the sender
    reads the address from stdin and prints the time it started."""
    import ucxx

    buffer = bytearray(os.urandom(size))
    if role == "api-receiver":
        print(ucxx.get_worker_address().tobytes().hex(), flush=True)
        for _ in range(count):
            await ucxx.recv(buffer, tag=TAG)
        print(time.monotonic(), flush=True)
        return
    address = ucxx.get_ucx_address_from_buffer(bytes.fromhex(sys.stdin.readline().strip()))
    endpoint = await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
    start = time.monotonic()
    for _ in range(count):
        await endpoint.send(buffer, tag=TAG, force_tag=True)
    print(start, flush=True)
    await asyncio.sleep(0.2)  # let the last completion reach the receiver before we go


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdflow.transports.ucx_bench", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _api_round(size: int, count: int) -> float:
    shape = ("--sizes", str(size), "--round-bytes", str(size * count))
    receiver = await _spawn("--role", "api-receiver", *shape)
    address = await asyncio.wait_for(receiver.stdout.readline(), 120)  # type: ignore[union-attr]
    sender = await _spawn("--role", "api-sender", *shape)
    sender.stdin.write(address)  # type: ignore[union-attr]
    await sender.stdin.drain()  # type: ignore[union-attr]
    start = float(await asyncio.wait_for(sender.stdout.readline(), 300))  # type: ignore[union-attr]
    last = float(await asyncio.wait_for(receiver.stdout.readline(), 300))  # type: ignore[union-attr]
    await asyncio.gather(sender.wait(), receiver.wait())
    return size * count / (last - start) / 1e9


async def _bench(sizes: list[int], round_bytes: int, rounds: int, paths: list[str]) -> dict:
    child = await _spawn("--role", "peer", "--sizes", str(max(sizes)))
    assert child.stdin is not None and child.stdout is not None
    addresses = msgspec.json.decode(await asyncio.wait_for(child.stdout.readline(), 120))
    sender = UcxTransport()
    worker = UcxWorker()
    raw_ep = worker.endpoint(bytes.fromhex(addresses["raw"]))
    results: dict[str, dict[int, list[float]]] = {p: {s: [] for s in sizes} for p in paths}
    for r in range(rounds + 1):
        for size in sizes:
            data = os.urandom(size)
            chunk = KvChunkHeader("bench", 0, -1, 0, 0, "uint8", (size,), 1, 0, size, checksum(data))
            count = max(1, round_bytes // size)
            for path in paths if r % 2 else list(reversed(paths)):
                if path == "ucxx-api":
                    gbps = await _api_round(size, count)
                else:
                    child.stdin.write(f"{path} {size} {count}\n".encode())
                    await child.stdin.drain()
                    start = time.monotonic()
                    for _ in range(count):
                        if path == "ucx":
                            await sender.write(addresses["ucx"], chunk, data)
                        else:
                            request = worker.send(raw_ep, data, TAG)
                            await worker.completion(request)
                            request.check_error()
                    last = float(await asyncio.wait_for(child.stdout.readline(), 300))
                    gbps = size * count / (last - start) / 1e9
                if r:  # round 0 warms up
                    results[path][size].append(gbps)
    child.stdin.close()
    await child.wait()
    await sender.aclose()
    worker.close(RuntimeError, "done")
    return results


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="65536,1048576,16777216", help="chunk sizes in bytes")
    parser.add_argument("--round-bytes", type=int, default=64 << 20, help="bytes per round and path")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (after 1 warm-up)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    parser.add_argument("--role", choices=["peer", "api-receiver", "api-sender"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    structlog.configure(  # stdout carries the children's replies
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    if args.role:
        size = int(args.sizes)
        asyncio.run(_peer(size) if args.role == "peer" else _api(args.role, size, args.round_bytes // size))
        return
    sizes, paths = [int(s) for s in args.sizes.split(",")], args.paths.split(",")
    results = asyncio.run(_bench(sizes, args.round_bytes, args.rounds, paths))
    mode = os.environ.get("UCXPY_PROGRESS_MODE", "thread")
    print(f"# python -m pdflow.transports.ucx_bench {' '.join(sys.argv[1:])}  ({os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, ucxx-api with UCXPY_PROGRESS_MODE={mode})")  # fmt: skip
    print("| chunk | " + " | ".join(f"{p} GB/s" for p in paths) + " | " +
          " | ".join(f"ucx / {p}" for p in paths if p != "ucx") + " |")  # fmt: skip
    print("|---" * (2 * len(paths)) + "|")
    for size in sizes:
        median = {p: statistics.median(results[p][size]) for p in paths}
        ratios = [f"{median['ucx'] / median[p]:.2f}x" for p in paths if p != "ucx" and "ucx" in median]
        cells = [f"{median[p]:.2f}" for p in paths] + ratios
        print(f"| {_label(size)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
