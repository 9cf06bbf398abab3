"""The receiving half of ``pdflow bench transfer``: a child process that lands chunks and says when.

The benchmark starts it as a :class:`Receiver` (:func:`peer_main`, with ``multiprocessing``
spawn and one end of a pipe) and sends it commands; every answer is a tuple whose first item is
its kind (``"error"`` with a traceback when something failed). It exits when the pipe closes,
so it never outlives the benchmark.

- ``("transport", name, options, region_bytes)``: create and start transport ``name`` (with
  ``options``, link shaping included), allocate region 0 in it, answer ``("ready", address)``;
  then answer each ``("collect", n)`` with ``("landed", [(offset, t), ...], errors)`` once ``n``
  more chunks are in, until ``("close",)``, answered ``("closed",)``.
- ``("socket", [(offset, nbytes), ...], region_bytes)``: the plain-socket baseline. Listen on
  127.0.0.1, answer ``("ready", port)``, accept one connection and ``recv_into`` each span in
  turn, answering ``("landed", ...)`` after each round of spans, until the sender closes at
  the start of a round: ``("closed",)``.
- ``("ucx-raw", [(offset, nbytes), ...], region_bytes)``: the ucx transport's floor, UCX tagged
  receives of the payload alone (no header, checksum or notice) on a
  :class:`~pdflow.transports.ucx_worker.UcxWorker`. Answer ``("ready", worker_address)``, then
  each ``("round",)`` with ``("landed", ...)`` once every span is in, until ``("close",)``.

``t`` is ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process on a host) when
``next_notice()`` hands the notice out, or when the socket span is full.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

TIMEOUT_S = 120.0  # the longest a round may take to land
UCX_TAG = 7


class Receiver:
    """The receiver process and the pipe to it."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=peer_main, args=(child,), name="bench-receiver", daemon=True)
        self.process.start()
        child.close()

    def reply(self) -> list[Any]:
        if not self.conn.poll(TIMEOUT_S):
            raise RuntimeError(f"the receiver did not answer within {TIMEOUT_S:.0f} s")
        try:
            kind, *rest = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the receiver died (exit code {self.process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the receiver failed:\n{rest[0]}")
        return rest

    def ask(self, *command: Any) -> list[Any]:
        self.conn.send(command)
        return self.reply()

    def tell(self, *command: Any) -> None:
        self.conn.send(command)

    async def reply_async(self) -> list[Any]:
        """reply() without stalling the event loop (a transport may need it to make progress)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.reply)

    async def ask_async(self, *command: Any) -> list[Any]:
        self.tell(*command)
        return await self.reply_async()

    def close(self) -> None:
        self.conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def peer_main(conn: Connection) -> None:
    """Obey commands from ``conn`` until it closes."""
    from pdflow.log import configure_logging

    configure_logging("console", "warning", stage="bench-receiver")
    try:
        import setproctitle

        setproctitle.setproctitle("pdflow::bench-receiver")
    except ImportError:
        pass
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if command[0] == "transport":
                import uvloop

                uvloop.run(_serve_transport(conn, *command[1:]))
            elif command[0] == "socket":
                _serve_socket(conn, *command[1:])
            elif command[0] == "ucx-raw":
                import uvloop

                uvloop.run(_serve_ucx_raw(conn, *command[1:]))
            else:
                raise ValueError(f"unknown command {command!r}")
        except (EOFError, BrokenPipeError):
            return
        except BaseException:
            conn.send(("error", traceback.format_exc()))


async def _serve_transport(conn: Connection, name: str, options: dict[str, Any], region_bytes: int) -> None:
    from pdflow import transports

    loop = asyncio.get_running_loop()
    landed: list[tuple[int, float]] = []
    errors: list[str] = []
    arrived = asyncio.Event()

    async def collect() -> None:
        while True:
            notice = await transport.next_notice()
            landed.append((notice.header.offset, time.monotonic()))
            if notice.error is not None:
                errors.append(repr(notice.error))
            arrived.set()

    async with transports.create(name, **options) as transport:
        transport.allocate(0, region_bytes)
        conn.send(("ready", transport.address_for(0)))
        collector = loop.create_task(collect())
        try:
            while (command := await loop.run_in_executor(None, conn.recv))[0] == "collect":
                want = command[1]
                async with asyncio.timeout(TIMEOUT_S):
                    while len(landed) < want:
                        if collector.done():  # it can only have failed
                            collector.result()
                        arrived.clear()
                        await arrived.wait()
                conn.send(("landed", landed[:want], errors[:]))
                del landed[:want]
                errors.clear()
        finally:
            collector.cancel()
    conn.send(("closed",))


def _serve_socket(conn: Connection, spans: list[tuple[int, int]], region_bytes: int) -> None:
    region = memoryview(bytearray(region_bytes))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(("ready", listener.getsockname()[1]))
        listener.settimeout(TIMEOUT_S)
        sock, _ = listener.accept()
    with sock:
        sock.settimeout(TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            landed: list[tuple[int, float]] = []
            for offset, nbytes in spans:
                view, got = region[offset : offset + nbytes], 0
                while got < nbytes:
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        if landed or got:
                            raise ConnectionError("the sender closed mid-round")
                        conn.send(("closed",))
                        return
                    got += n
                landed.append((offset, time.monotonic()))
            conn.send(("landed", landed, []))


async def _serve_ucx_raw(conn: Connection, spans: list[tuple[int, int]], region_bytes: int) -> None:
    from pdflow.transports.ucx_worker import UcxWorker

    loop = asyncio.get_running_loop()
    region = memoryview(bytearray(region_bytes))
    worker = UcxWorker()
    try:
        conn.send(("ready", worker.address))
        while (await loop.run_in_executor(None, conn.recv))[0] == "round":
            landed: list[tuple[int, float]] = []
            async with asyncio.timeout(TIMEOUT_S):
                for offset, nbytes in spans:
                    request = worker.recv(region[offset : offset + nbytes], UCX_TAG)
                    await worker.completion(request)
                    request.check_error()
                    landed.append((offset, time.monotonic()))
            conn.send(("landed", landed, []))
    finally:
        worker.close(RuntimeError, "benchmark cell done")
    conn.send(("closed",))
