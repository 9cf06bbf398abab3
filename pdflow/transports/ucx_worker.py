"""One UCX worker, progressed by the asyncio loop that made it (no progress thread).

ucxx's own asyncio layer keeps one worker per process, progresses it from a thread (or a task
that polls without end), and has every pending request spin on ``asyncio.sleep(0)``; on two busy
cores that starves the very copies it waits for (measured against ucxx's own API with the former
``pdflow/transports/ucx_bench.py``, in git history; ``pdflow bench transfer`` measures ``ucx-raw``).
:class:`UcxWorker` instead gives each transport its own worker and progresses it inside the
loop's callbacks: when the worker's file descriptor signals, when a request is posted, and as a
once-a-second backstop. Completions resolve futures (:meth:`UcxWorker.completion`) or run
callbacks on the spot (:meth:`UcxWorker.when_done`), so a receive pipeline needs no task switch.

Importing this module loads libucx through ``ucxx`` (ImportError when it is not installed).
Two UCX settings get defaults first, because UCX reads them once when it loads: its log lines
go to stderr (``UCX_LOG_FILE``; UCX's default is stdout, which would garble anything that
speaks over stdout) and unused-variable warnings are off (``ucxx`` itself sets
``UCX_MEMTYPE_CACHE``, which UCX >= 1.19 no longer knows). Set them yourself to override.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Callable
from typing import Any

import structlog

os.environ.setdefault("UCX_LOG_FILE", "stderr")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

try:
    import ucxx  # noqa: F401  (loads libucx and sets ucxx's environment defaults)
    from ucxx._lib import libucxx as ucx_api
    from ucxx._lib.arr import Array
except (ImportError, OSError) as exc:  # OSError: the wheel is there, libucx.so is not loadable
    raise ImportError(f"ucxx is not usable: {exc}") from exc

UCXError = ucx_api.UCXError
UCXMessageTruncatedError = ucx_api.UCXMessageTruncatedError

log = structlog.get_logger()

_MAX_PASSES = 32  # progress passes in one go before the loop gets its turn
_BUDGET_S = 0.001  # or this much time, whichever comes first
_DRAIN_PASSES = 1 << 16  # progress(): until idle (a bound, should a peer keep sending)
_KEPT_FOREVER: list[Any] = []  # workers that cannot be destroyed safely (see UcxWorker.close)

_context: Any = None


def context() -> Any:
    """The process's UCX context (tag matching + wakeup), made on first use."""
    global _context
    if _context is None:
        _context = ucx_api.UCXContext({}, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    return _context


class UcxWorker:
    """A UCX worker driven by the running event loop; :meth:`close` it when done.

    Progress runs in the loop's own callbacks: when the worker's file descriptor signals, right
    after a request is posted (many complete on the spot), and once a second while requests
    are pending (a backstop for an event UCX does not signal, e.g. room freed in a peer's FIFO).
    Every progress ends with the worker armed again, as UCX requires before the next sleep. One
    go yields to the loop after 1 ms (the rest of the process runs, then it goes on), so that a
    stream of chunks cannot starve the process's other coroutines.
    ``poll_s`` > 0 keeps polling (one pass per loop iteration) that long after the last
    completion: lower latency on idle cores, worse on busy ones (measured: the former ucx_bench).
    """

    def __init__(self, poll_s: float = 0.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker = ucx_api.UCXWorker(context())
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()
        self.poll_s = poll_s
        self._pending: dict[Any, asyncio.Future[None] | Callable[[Any], None]] = {}
        self._kept: set[Any] = set()  # requests nobody waits for, held until they complete
        self._busy_until = 0.0
        self._polling = False
        self._kicking = False
        self._open = True
        self._closed_with: Callable[[], BaseException] = lambda: RuntimeError("the UCX worker is closed")
        self._fd = self.worker.epoll_file_descriptor
        self.loop.add_reader(self._fd, self._kick)
        self._backstop = self.loop.call_later(1.0, self._tick)

    def endpoint(self, address: bytes, error_handling: bool = False) -> Any:
        """An endpoint to the worker at ``address``. Without UCX error handling UCX may pick
        shared memory and CMA (error handling restricts it to transports that detect a dead
        peer, i.e. TCP here), and whoever uses it must detect a dead peer another way. Shared
        memory needs the peer in this network namespace too (UCX wakes a sleeping receiver
        through an abstract unix socket, which is per namespace): pass ``error_handling`` for a
        peer that is not."""
        ucx_address = ucx_api.UCXAddress.create_from_buffer(address)
        return ucx_api.UCXEndpoint.create_from_worker_address(self.worker, ucx_address, error_handling)

    def send(self, endpoint: Any, data: memoryview | bytes, tag: int) -> Any:
        """Post a tagged send of ``data`` (read from its own memory until the request completes).
        UCXError if ``endpoint`` (with error handling) has seen its peer fail."""
        if not endpoint.alive:  # ucxx would hand back an empty request, which crashes on first use
            raise UCXError("the endpoint's peer failed")
        return endpoint.tag_send(Array(data), ucx_api.UCXXTag(tag))

    def close_endpoint(self, endpoint: Any) -> None:
        """Close ``endpoint`` in the background (see :meth:`keep`); one whose peer failed (with
        error handling) ucxx has closed already."""
        if endpoint.alive:
            self.keep(endpoint.close())

    def recv(self, buffer: memoryview | bytearray, tag: int) -> Any:
        """Post a tagged receive straight into ``buffer`` (written until the request completes)."""
        return self.worker.tag_recv(Array(buffer), ucx_api.UCXXTag(tag))

    def completion(self, request: Any) -> asyncio.Future[None]:
        """A future resolved (with None) once ``request`` completes, successfully or not: call
        ``request.check_error()`` then. Its owner may fail or cancel it earlier (the request
        itself stays posted until it is dropped or its endpoint closed)."""
        future = self.loop.create_future()
        self._track(request, future)
        return future

    def when_done(self, request: Any, callback: Callable[[Any], None]) -> None:
        """Call ``callback(request)`` once ``request`` completes, from inside progress: it runs
        before the loop does anything else, which keeps a receive pipeline free of task hops.
        It may post and track new requests; it must not raise."""
        self._track(request, callback)

    def _track(self, request: Any, waiter: asyncio.Future[None] | Callable[[Any], None]) -> None:
        if not self._open:  # nothing completes any more
            if isinstance(waiter, asyncio.Future):
                waiter.set_exception(self._closed_with())
            return
        self._pending[request] = waiter
        self._busy_until = self.loop.time() + self.poll_s
        self._kick()  # it may complete right here (e.g. a match for what already arrived)

    def progress(self) -> None:
        """Progress until idle now, without the fairness budget: deliver everything that had
        arrived (e.g. before a peer went away), running the callbacks of what completes. Does
        nothing once closed."""
        self._kick(drain=True)

    def keep(self, request: Any) -> None:
        """Hold ``request`` (e.g. an endpoint's close) until it completes or the worker closes:
        dropping a pending request cancels it."""
        if not request.completed:
            self._kept.add(request)

    def forget(self, request: Any) -> None:
        """Stop tracking ``request`` (its owner gave up on it and is about to drop it, which
        cancels it)."""
        self._pending.pop(request, None)

    def _kick(self, drain: bool = False) -> None:
        """Progress until idle, resolve what completed, then arm (or keep polling)."""
        if self._kicking or not self._open:
            return  # (a callback posted something: the running pass picks it up)
        self._kicking = True
        try:
            self._progress_and_arm(drain)
        finally:
            self._kicking = False

    def _progress_and_arm(self, drain: bool) -> None:
        start = self.loop.time()
        for _ in range(_DRAIN_PASSES if drain else _MAX_PASSES):
            busy = self.worker.progress_once()  # then completions: a callback may want to
            done = [  # touch what just landed while it is still in cache
                (r, w)
                for r, w in self._pending.items()
                if r.completed or (isinstance(w, asyncio.Future) and w.done())
            ]
            for request, waiter in done:
                if self._pending.pop(request, None) is None:
                    continue  # a callback before this one forgot it
                if not isinstance(waiter, asyncio.Future):
                    try:
                        waiter(request)
                    except Exception:  # a bug: keep progressing the others
                        log.exception("kv.ucx.callback.failed")
                elif not waiter.done():
                    waiter.set_result(None)
            if self._kept:
                self._kept = {r for r in self._kept if not r.completed}
            now = self.loop.time()
            if busy or done:
                self._busy_until = now + self.poll_s
                if now - start > _BUDGET_S and not drain:
                    break  # fairness: the loop's other work goes first, then we go on
                continue  # callbacks may have posted requests that can complete now
            if self._pending and now < self._busy_until:
                break  # keep polling, from the loop
            if not self._open or self.worker.arm():  # False: events came in meanwhile
                return
        # still busy: let the loop run everything else (e.g. a peer in this process), then go on
        if self._open and not self._polling:
            self._polling = True
            self.loop.call_soon(self._poll)

    def _poll(self) -> None:
        self._polling = False
        self._kick()

    def _tick(self) -> None:
        if self._open:
            if self._pending or self._kept:
                self._kick()
            self._backstop = self.loop.call_later(1.0, self._tick)

    def close(self, error: type[BaseException], message: str) -> None:
        """Stop progressing and fail every pending future with ``error(message)``. Idempotent.

        Nothing lands here after this (receives complete only inside our progress calls); a peer
        that already holds a send's rendezvous may still read its source memory with CMA.
        """
        if not self._open:
            return
        self._open, self._closed_with = False, lambda: error(message)
        self._backstop.cancel()
        self.loop.remove_reader(self._fd)
        for waiter in self._pending.values():
            if isinstance(waiter, asyncio.Future) and not waiter.done():
                waiter.set_exception(self._closed_with())
        self._pending.clear()  # dropping the requests cancels them
        self._kept.clear()
        for _ in range(_DRAIN_PASSES):  # what sits in the shared-memory FIFOs becomes visible
            if not self.worker.progress_once():
                break
        if self.worker.tag_probe(ucx_api.UCXXTag(0), ucx_api.UCXXTagMask(0)).matched:
            # ucxx's worker destructor receives unmatched messages itself, after the endpoints
            # are gone, and UCX then crashes the process on a rendezvous from a peer that died
            # or failed before (UCX 1.21 / ucxx 0.52: ucp_proto_rndv_send_reply from
            # Worker::drainWorkerTagRecv, seen here). Receiving them ourselves crashes the same
            # way. So such a worker is kept, unused, for the life of the process.
            _KEPT_FOREVER.append(self.worker)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.worker))  # not even freed at exit
            log.info("kv.ucx.worker.kept", reason="unmatched messages from gone peers")
