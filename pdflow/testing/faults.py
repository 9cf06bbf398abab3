"""Faults against a running `pdflow run` (a :class:`~pdflow.testing.server.PdflowServer`): load
whose every request is accounted for, faults to inject under it, and the invariants that must
hold after each. Used by tests/test_faults.py (bounded) and experiments/reliability.py (at length).

Every request of the load ends one of four ways:

- ``ok``: a whole answer (a finish reason, then ``[DONE]``);
- ``error``: a clear error (an HTTP error status with OpenAI's error body, an error event in the
  stream, or the connection closed by the server) within the bound;
- ``aborted``: the client hung up on purpose (random aborts);
- ``lost``: none of these within the bound, or an answer cut short with no error. Never allowed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdflow.testing.local_http import tls_context

PROMPTS = ["Tell me about the sea.", "Name three colours.", "What is 7 times 8?", "Describe a cat.",
           "Write a line about the moon.", "Why is the sky blue?"]


@dataclass(slots=True)
class Outcome:
    kind: str  # ok | error | aborted | lost
    seconds: float
    detail: str = ""


@dataclass
class Load:
    """``clients`` threads streaming chat requests until :meth:`stop`; ``abort_ratio`` of them hang
    up after a few chunks, ``slow_ratio`` of them read their stream slowly (``slow_read_s``
    between chunks). ``bound_s``: how long a request may take to end one way or another."""

    url: str
    clients: int = 4
    abort_ratio: float = 0.2
    max_tokens: int = 16
    bound_s: float = 60.0
    seed: int = 0
    slow_ratio: float = 0.0
    slow_read_s: float = 0.2
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.bound_s + 10)
        return self.outcomes

    def counts(self) -> Counter:
        with self._lock:
            return Counter(o.kind for o in self.outcomes)

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with httpx.Client(timeout=httpx.Timeout(self.bound_s, connect=10), verify=tls_context()) as http:
            while not self._stop.is_set():
                abort_after = rng.randint(1, 3) if rng.random() < self.abort_ratio else None
                pause = self.slow_read_s if rng.random() < self.slow_ratio else 0.0
                outcome = one_request(http, self.url, rng.choice(PROMPTS), self.max_tokens, abort_after, pause)
                with self._lock:
                    self.outcomes.append(outcome)


def one_request(http: httpx.Client, url: str, prompt: str, max_tokens: int, abort_after: int | None,
                pause_s: float = 0.0) -> Outcome:
    """One streamed chat request, classified (see the module doc); ``pause_s`` between chunks
    makes it a slow reader."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    start = time.monotonic()

    def took() -> float:
        return time.monotonic() - start

    try:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                clear = "error" in text and response.status_code >= 400
                return Outcome("error" if clear else "lost", took(), f"HTTP {response.status_code}: {text[:200]}")
            chunks, finished = 0, False
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return Outcome("ok" if finished else "lost", took(), "" if finished else "[DONE] without a finish")
                event = json.loads(data)
                if "error" in event:
                    return Outcome("error", took(), event["error"].get("message", "")[:200])
                chunks += 1
                if pause_s:
                    time.sleep(pause_s)
                if any(c.get("finish_reason") for c in event.get("choices", [])):
                    finished = True
                if abort_after is not None and chunks >= abort_after:
                    return Outcome("aborted", took())
            return Outcome("lost", took(), "the stream ended without [DONE] or an error")
    except httpx.TimeoutException as exc:
        return Outcome("lost", took(), f"no end within the bound: {exc!r}")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError) as exc:
        return Outcome("error", took(), f"connection closed by the server: {exc!r}")


# --- faults ------------------------------------------------------------------------------------


def stage_pids(server) -> dict[str, int]:
    return {name: info["pid"] for name, info in (server.health() or {}).get("stages", {}).items()}


def kill9(server, stage: str) -> int:
    """SIGKILL the replica named ``stage`` (e.g. ``"decode-0"``); its pid."""
    pid = stage_pids(server)[stage]
    os.kill(pid, signal.SIGKILL)
    return pid


def freeze(server, stage: str, seconds: float) -> int:
    """SIGSTOP the replica for ``seconds`` (then SIGCONT, if it still exists); its pid."""
    pid = stage_pids(server)[stage]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    return pid


def wait_replaced(server, stage: str, old_pid: int, timeout_s: float = 180.0) -> float | None:
    """Seconds until ``stage`` runs under a new pid and the server is healthy again (None: not
    within ``timeout_s``). Healthy alone is not enough: just after a fault the launcher may not
    have noticed it yet."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        body = server.health() or {}
        info = body.get("stages", {}).get(stage, {})
        if body.get("status") == "ok" and info.get("pid") not in (None, old_pid):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


# --- invariants ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def proc_status(pid: int, key: str) -> int:
    """A number from /proc/<pid>/status (``VmRSS`` in kB, ``Threads``); 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        return 0


def shm_segments() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if "pdflow" in name}
    except FileNotFoundError:
        return set()


def settled(server, timeout_s: float = 60.0) -> dict:
    """Wait until the server is healthy with nothing in flight anywhere, no KV lease held and every
    block of decode's pool free; its /health. AssertionError naming what did not settle."""
    deadline = time.monotonic() + timeout_s
    problems = ["no answer from /health"]
    if hasattr(server, "fresh_stats"):  # (what /health shows from here on came after the call)
        server.fresh_stats(min(timeout_s / 2, 10.0))
    while time.monotonic() < deadline:
        body = server.health()
        if body is not None:
            problems = []
            if body["status"] != "ok":
                problems.append(f"status {body['status']} (down: {body['down']})")
            if body["in_flight"]:
                problems.append(f"ingress holds {body['in_flight']} requests")
            for name, info in body["stages"].items():
                if info["in_flight"]:
                    problems.append(f"{name} holds {info['in_flight']} requests")
                stats = info.get("stats", {})
                if stats.get("leases") or stats.get("leased_blocks"):
                    problems.append(f"{name} holds {stats.get('leases')} leases, {stats.get('leased_blocks')} leased blocks")
                if stats.get("pool_free_blocks") != stats.get("pool_blocks"):
                    problems.append(f"{name} holds {stats['pool_blocks'] - stats['pool_free_blocks']} pool blocks")
            if not problems:
                return body
        time.sleep(0.25)
    raise AssertionError("did not settle: " + "; ".join(problems))


def none_left_behind(old_pids: list[int], shm_before: set[str]) -> None:
    """Every killed replica's process is gone (not a zombie) and no shared-memory segment stayed."""
    lingering = [pid for pid in old_pids if alive(pid)]
    assert not lingering, f"processes left behind: {lingering}"
    extra = shm_segments() - shm_before
    assert not extra, f"shared-memory segments left behind: {sorted(extra)}"


# libuv's worker pool (uvloop resolves names and touches files through it): its fixed number of
# threads start together on its first use, which can come at any time in a process's life (a
# soak saw a kv-shuttle go from 6 threads to 10): not threads the process's own work leaves behind
_POOL_THREAD = "libuv-worker"


def own_threads(pid: int) -> int:
    """The threads of process ``pid`` but libuv's worker pool; 0 when gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    names = []
    for task in tasks:
        try:
            names.append(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
        except FileNotFoundError:  # (ended meanwhile)
            continue
    return sum(name != _POOL_THREAD for name in names)


def footprint(server) -> dict[str, dict[str, int]]:
    """Each replica's RSS (kB), threads (:func:`own_threads`) and open file descriptors."""
    return {name: {"rss_kb": proc_status(pid, "VmRSS"), "threads": own_threads(pid),
                   "fds": open_fds(pid)} for name, pid in stage_pids(server).items()}
