#!/usr/bin/env python
"""Two front doors (ingress replicas), one killed under load: what the survivor's clients see.

One `pdflow run` (the test topology, `pdflow.testing.server.front_doors_topology`: two ingress
replicas on ports of their own), and for each of ``--rounds`` rounds: ``--streams`` streamed
requests spread over the two doors by a round robin (the official `openai` client), kill -9 of
door 1 once every stream has its first token, then a new request on door 0 every ``--probe-ms``
for ``--probe-s`` seconds. Measured per round:

- the streams on door 0: how many completed whole (the target: all);
- the first request sent to door 0 after the kill: how long after the kill it was answered, and
  whether every probe succeeded (the target: new requests succeed within 1 s);
- the streams on door 1: each retried on door 0 by its client, and completed there.

Between rounds the launcher restarts door 1 and the run waits for it.

    .venv/bin/python experiments/experiment_front_doors.py --rounds 5

Prints a markdown report (also <out>/summary.md).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import openai

from pdflow.bench.experiments import Report, experiment_parser, serving
from pdflow.testing import faults
from pdflow.testing.server import FRONT_DOOR_PORTS, front_doors_topology

REPORT = Report()
say = REPORT.say
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def one_round(server, doors: list[str], streams: int, tokens: int, probe_s: float, probe_ms: float) -> dict:
    started = threading.Barrier(streams + 1)
    results: list[dict] = [{} for _ in range(streams)]

    def stream(i: int) -> None:
        door = doors[i % 2]
        results[i] = {"door": i % 2, "tries": 0}
        for _ in range(2):
            results[i]["tries"] += 1
            try:
                first = True
                for chunk in client(door).chat.completions.create(model="smollm2", messages=STORY, temperature=0,
                                                                  max_tokens=tokens, stream=True):
                    if first and results[i]["tries"] == 1:
                        first = False
                        started.wait(120)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        results[i]["finish"] = chunk.choices[0].finish_reason
                return
            except openai.APIError:
                door = doors[0]  # the client retries on the other door

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    started.wait(120)
    old = faults.kill9(server, "ingress-1")
    killed = time.monotonic()
    probes, first_ok = [], None
    while time.monotonic() - killed < probe_s:
        sent = time.monotonic()
        try:
            client(doors[0]).chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=2)
            ok = True
        except openai.APIError:
            ok = False
        probes.append(ok)
        if ok and first_ok is None:
            first_ok = time.monotonic() - killed
        time.sleep(max(0.0, probe_ms / 1e3 - (time.monotonic() - sent)))
    for thread in threads:
        thread.join(300)
    faults.wait_replaced(server, "ingress-1", old, 120)
    faults.settled(server)
    survivor = [r for r in results if r.get("door") == 0]
    killed_door = [r for r in results if r.get("door") == 1]
    return {"survivor_streams": len(survivor), "survivor_whole": sum(r.get("finish") == "length" for r in survivor),
            "retried": len(killed_door), "retried_whole": sum(r.get("finish") == "length" and r["tries"] == 2
                                                              for r in killed_door),
            "first_ok_s": first_ok, "probes": len(probes), "probes_ok": sum(probes)}


def main() -> int:
    p = experiment_parser(__doc__, "front-doors")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--probe-s", type=float, default=3.0)
    p.add_argument("--probe-ms", type=float, default=100.0)
    opts = p.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    REPORT.header("Two front doors, one killed")
    rounds = []
    with serving(topology=lambda base: front_doors_topology(base, 2), ports=FRONT_DOOR_PORTS) as server:
        doors = [server.url, f"http://127.0.0.1:{server.base + 1}"]
        for i in range(opts.rounds):
            rounds.append(one_round(server, doors, opts.streams, opts.tokens, opts.probe_s, opts.probe_ms))
            print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr, flush=True)
    say(f"{opts.rounds} rounds; {opts.streams} streams of {opts.tokens} tokens a round over two doors (round robin); "
        f"kill -9 of door 1 once each has its first token; a 2-token request on door 0 every {opts.probe_ms:g} ms "
        f"for {opts.probe_s:g} s after it.")
    say()
    say("| round | streams on door 0, whole | door 1's streams retried on door 0, whole | first answer on door 0 "
        "after the kill (ms) | probes answered |")
    say("|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds, 1):
        first = "-" if r["first_ok_s"] is None else f"{r['first_ok_s'] * 1e3:.0f}"
        say(f"| {i} | {r['survivor_whole']} / {r['survivor_streams']} | {r['retried_whole']} / {r['retried']} | "
            f"{first} | {r['probes_ok']} / {r['probes']} |")
    firsts = [r["first_ok_s"] for r in rounds if r["first_ok_s"] is not None]
    if firsts:
        say()
        say(f"First answer on the survivor after the kill: median {statistics.median(firsts) * 1e3:.0f} ms, "
            f"at most {max(firsts) * 1e3:.0f} ms.")
    REPORT.write(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
