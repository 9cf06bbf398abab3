#!/usr/bin/env python
"""One-way latency of one control-plane hop, as the stages have it: a zmq.asyncio PUSH in one
uvloop process to a PULL in another, over loopback TCP. One small message every --every-ms
(default 20), so each one wakes an idle receiver, as tokens spaced by decode steps do. The
time is ``time.monotonic()`` sent inside the message and read on arrival (one clock per host).

    .venv/bin/python experiments/bench_zmq_hop.py --messages 300
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import struct
import time

import uvloop
import zmq
import zmq.asyncio

from pdflow.bench.experiments import experiment_parser

STAMP = struct.Struct("d")


async def _receive(address: str, count: int, results) -> None:
    sock = zmq.asyncio.Context().socket(zmq.PULL)
    sock.bind(address)
    delays = []
    for _ in range(count):
        message = await sock.recv()
        delays.append(time.monotonic() - STAMP.unpack(message)[0])
    results.put(delays)


def _receiver(address: str, count: int, results) -> None:
    uvloop.run(_receive(address, count, results))


async def _send(address: str, count: int, every_s: float) -> None:
    sock = zmq.asyncio.Context().socket(zmq.PUSH)
    sock.connect(address)
    await asyncio.sleep(0.5)  # connected
    for _ in range(count):
        await sock.send(STAMP.pack(time.monotonic()))
        await asyncio.sleep(every_s)


def main() -> None:
    parser = experiment_parser(__doc__)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--every-ms", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=39555)
    parser.add_argument("--address", help="a zmq address instead, e.g. ipc:///tmp/hop.sock")
    args = parser.parse_args()
    address = args.address or f"tcp://127.0.0.1:{args.port}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_receiver, args=(address, args.messages, results))
    receiver.start()
    uvloop.run(_send(address, args.messages, args.every_ms / 1000))
    delays = sorted(results.get(timeout=60)[20:])  # the first ones include connection set-up
    receiver.join()
    print(f"zmq PUSH -> PULL one-way, {len(delays)} messages: p50 {statistics.median(delays) * 1e6:.0f} µs, "
          f"p90 {delays[int(0.9 * (len(delays) - 1))] * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
