"""How one cell of ``pdflow bench transfer`` is measured: the workloads, a cell's figures and
budget, and the sender's side of each path (memcpy, plain socket, ucx-raw, a transport); the
receiver is :mod:`pdflow.bench.transfer_peer`.

The definitions (GB/s, latency, rounds) are in :mod:`pdflow.bench.transfer`.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pdflow import transports
from pdflow.bench.transfer_peer import TIMEOUT_S, UCX_TAG, Receiver

KIB, MIB = 1 << 10, 1 << 20
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
DEFAULT_TOKENS = (512, 2048, 8192)
DEFAULT_RAW = (64 * KIB, MIB, 16 * MIB)


def size_label(nbytes: int) -> str:
    """``65536`` -> ``"64 KiB"``, ``1572864`` -> ``"1.5 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True, slots=True)
class Workload:
    """One round's chunks: (layer, kind, offset, nbytes) spans of a region of ``region_bytes``."""

    name: str
    spans: tuple[tuple[int, int, int, int], ...]
    region_bytes: int
    tokens: int = 0  # 0: raw chunks

    @property
    def chunk_bytes(self) -> int:
        return max(span[3] for span in self.spans)

    @property
    def round_bytes(self) -> int:
        return sum(span[3] for span in self.spans)


def workloads(tokens: tuple[int, ...], raw_sizes: tuple[int, ...], round_bytes: int) -> list[Workload]:
    from pdflow.kv.layout import KEYS, VALUES, KvLayout

    layout = KvLayout(**SMOLLM2)
    found = []
    for n in tokens:
        spans = tuple(
            (layer, kind, layout.offset(n, layer, kind), layout.block_bytes(n))
            for layer in range(layout.num_layers) for kind in (KEYS, VALUES)
        )  # fmt: skip
        label = f"{n // 1024}K" if n % 1024 == 0 else str(n)
        found.append(Workload(f"kv {label} tok", spans, layout.request_bytes(n), n))
    for size in raw_sizes:
        count = max(1, round_bytes // size)
        spans = tuple((0, -1, i * size, size) for i in range(count))
        found.append(Workload(f"raw {size_label(size)}", spans, count * size))
    return found


@dataclass(slots=True)
class Cell:
    """One path (a transport or a baseline) on one workload."""

    path: str
    workload: Workload
    baseline: bool = False
    gbps_rounds: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add_round(self, started: list[float], landed: list[tuple[int, float]]) -> None:
        """``started``: each span's write time, in span order; ``landed``: (offset, time) pairs."""
        by_offset = {span[2]: t for span, t in zip(self.workload.spans, started)}
        self.latencies += [t - by_offset[offset] for offset, t in landed]
        self.gbps_rounds.append(self.workload.round_bytes / (max(t for _, t in landed) - started[0]) / 1e9)

    def merge(self, other: Cell) -> None:
        """Take in the rounds of another pass of the same path and workload."""
        self.gbps_rounds += other.gbps_rounds
        self.latencies += other.latencies
        self.errors += other.errors
        self.seconds += other.seconds

    @property
    def gbps(self) -> float:
        return statistics.median(self.gbps_rounds)

    def latency(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # the nearest rank at or above

    def as_json(self, baselines: dict[str, float]) -> dict[str, Any]:
        """The cell as the results document has it; ``ratio`` to each of ``baselines`` (GB/s)."""
        return {
            "path": self.path, "baseline": self.baseline, "workload": self.workload.name,
            "chunk_bytes": self.workload.chunk_bytes, "round_bytes": self.workload.round_bytes,
            "gbps": self.gbps, "gbps_rounds": self.gbps_rounds, "rounds": len(self.gbps_rounds),
            "latency_s": {"median": self.latency(0.5), "p99": self.latency(0.99)},
            "ratio": {name: self.gbps / gbps for name, gbps in baselines.items()},
            "errors": self.errors, "seconds": self.seconds,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Budget:
    repeat: int
    seconds: float

    def split(self, passes: int) -> Budget:
        """The budget of one of ``passes`` interleaved passes: its share of rounds and seconds."""
        return Budget(-(-self.repeat // passes), self.seconds / passes)

    def rounds(self) -> Iterator[bool]:
        """False for the warm-up round, then True for each measured one: ``repeat`` of them at
        most, and no new one once ``seconds`` have passed (at least one)."""
        yield False
        start = time.monotonic()
        for _ in range(self.repeat):
            yield True
            if time.monotonic() - start >= self.seconds:
                return


@dataclass(slots=True)
class Source:
    """The bytes a workload sends (random, so no transport can compress them), and its headers."""

    data: Any  # numpy uint8 array of region_bytes
    headers: list[Any]

    @classmethod
    def of(cls, workload: Workload, seed: int = 0) -> Source:
        import numpy as np

        from pdflow.transports.checksum import checksum
        from pdflow.messages import KvChunkHeader

        data = np.frombuffer(np.random.default_rng(seed).bytes(workload.region_bytes), np.uint8)
        headers = []
        for layer, kind, offset, nbytes in workload.spans:
            dtype, shape = ("float32", (nbytes // 4,)) if kind >= 0 else ("uint8", (nbytes,))
            digest = checksum(data[offset : offset + nbytes])
            headers.append(
                KvChunkHeader("bench", layer, kind, 0, workload.tokens, dtype, shape, 0, offset, nbytes, digest)
            )
        return cls(data, headers)

    def chunk(self, span: tuple[int, int, int, int]) -> Any:
        return self.data[span[2] : span[2] + span[3]]


def memcpy_cell(workload: Workload, source: Source, budget: Budget) -> Cell:
    import numpy as np

    cell = Cell("memcpy", workload, baseline=True)
    target = np.zeros(workload.region_bytes, np.uint8)  # touched: no page faults while timed
    pairs = [(target[s[2] : s[2] + s[3]], source.chunk(s)) for s in workload.spans]
    for measured in budget.rounds():
        started, landed = [], []
        for (dst, src), span in zip(pairs, workload.spans):
            started.append(time.monotonic())
            np.copyto(dst, src)
            landed.append((span[2], time.monotonic()))
        if measured:
            cell.add_round(started, landed)
    return cell


def socket_cell(receiver: Receiver, workload: Workload, source: Source, budget: Budget) -> Cell:
    cell = Cell("socket", workload, baseline=True)
    (port,) = receiver.ask("socket", [(s[2], s[3]) for s in workload.spans], workload.region_bytes)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunks = [memoryview(source.chunk(s)) for s in workload.spans]
        for measured in budget.rounds():
            started = []
            for chunk in chunks:
                started.append(time.monotonic())
                sock.sendall(chunk)
            landed, errors = receiver.reply()
            if measured:
                cell.add_round(started, landed)
    receiver.reply()  # ("closed",)
    return cell


async def transport_cell(
    receiver: Receiver, name: str, options: dict[str, str], workload: Workload, source: Source, budget: Budget
) -> Cell:
    cell = Cell(name, workload)
    (address,) = await receiver.ask_async("transport", name, options, workload.region_bytes)
    chunks = list(zip(source.headers, (source.chunk(s) for s in workload.spans)))
    async with transports.create(name, **options) as sender:
        for measured in budget.rounds():
            started = []
            for header, data in chunks:
                started.append(time.monotonic())
                await sender.write(address, header, data)
            landed, errors = await receiver.ask_async("collect", len(chunks))
            cell.errors += errors
            if measured:
                cell.add_round(started, landed)
    await receiver.ask_async("close")
    return cell


async def ucx_raw_cell(receiver: Receiver, workload: Workload, source: Source, budget: Budget) -> Cell:
    """The ucx transport's floor: UCX tagged send/recv of the payloads alone, on the same
    :class:`~pdflow.transports.ucx_worker.UcxWorker` the transport uses (no header, checksum or
    notice), one awaited send after another."""
    from pdflow.transports.ucx_worker import UcxWorker

    cell = Cell("ucx-raw", workload, baseline=True)
    spans = [(s[2], s[3]) for s in workload.spans]
    (address,) = await receiver.ask_async("ucx-raw", spans, workload.region_bytes)
    worker = UcxWorker()
    try:
        endpoint = worker.endpoint(address)
        chunks = [memoryview(source.chunk(s)) for s in workload.spans]
        for measured in budget.rounds():
            receiver.tell("round")
            started = []
            for chunk in chunks:
                started.append(time.monotonic())
                request = worker.send(endpoint, chunk, UCX_TAG)
                await worker.completion(request)
                request.check_error()
            landed, errors = await receiver.reply_async()
            if measured:
                cell.add_round(started, landed)
    finally:
        worker.close(RuntimeError, "benchmark cell done")
    await receiver.ask_async("close")
    return cell
