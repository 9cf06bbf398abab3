"""The reliability figures of docs/reliability.md, at length: faults under load and a soak.

    .venv/bin/python experiments/reliability.py                       # everything (about 25 minutes)
    .venv/bin/python experiments/reliability.py --parts faults --rounds 2
    .venv/bin/python experiments/reliability.py --parts soak --requests 3000

faults: for each stage (prefill, kv-shuttle, decode, and an egress stage: this part's pipeline
has one, so that it is covered too) and each fault (kill -9; SIGSTOP
past the heartbeat deadline), ``--rounds`` times, under ``--clients`` streaming clients with
random aborts: every request must end whole (migrated, perhaps), with a clear error or aborted
by its client (none lost), and afterwards nothing may be in flight, no lease held, no old
process or shared-memory segment left. link: a prefill -> kv_shuttle link that drops, corrupts
and stalls chunks, under load with aborting and slow clients. soak: ``--requests`` short streamed requests, a third aborted, on a server with no
fault: none lost or failed, every stage's RSS, threads and open files before and after.

Each part starts its own `pdflow run` (tcp data plane). Prints a table per part and writes
everything to ``--out`` (JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pdflow.bench.experiments import experiment_parser, serving
from pdflow.testing import faults

STAGES = ("prefill-0", "kv-shuttle-0", "decode-0", "egress-0")
HEARTBEAT_TIMEOUT_S = 10  # PdflowServer's topology


def run_faults(rounds: int, clients: int) -> dict:
    rows = []
    with serving(egress=True) as server:
        shm_before = faults.shm_segments()
        for round_ in range(rounds):
            for stage in STAGES:
                for fault in ("kill -9", "SIGSTOP"):
                    faults.settled(server, 120)
                    migrated_before = _migrations(server)
                    load = faults.Load(server.url, clients=clients, abort_ratio=0.2, max_tokens=16, bound_s=60,
                                       seed=len(rows)).start()
                    time.sleep(3)
                    started = time.monotonic()
                    if fault == "kill -9":
                        old = faults.kill9(server, stage)
                    else:
                        old = faults.freeze(server, stage, HEARTBEAT_TIMEOUT_S + 2)
                    back = faults.wait_replaced(server, stage, old, 180)
                    healthy, back_s = back is not None, time.monotonic() - started
                    time.sleep(3)
                    load.stop()
                    settled = True
                    try:
                        faults.settled(server, 60)
                        faults.none_left_behind([old], shm_before)
                    except AssertionError as exc:
                        settled = str(exc)
                    counts = load.counts()
                    errors = [o.seconds for o in load.outcomes if o.kind == "error"]
                    row = {"round": round_, "stage": stage, "fault": fault, "requests": sum(counts.values()),
                           **{k: counts[k] for k in ("ok", "error", "aborted", "lost")},
                           "migrated": _migrations(server) - migrated_before,
                           "slowest_error_s": round(max(errors, default=0.0), 2), "back_in_s": round(back_s, 1),
                           "healthy": healthy, "clean_after": settled}
                    rows.append(row)
                    print(_row(row), flush=True)
    return {"rows": rows, "faults": len(rows), "requests": sum(r["requests"] for r in rows),
            "lost": sum(r["lost"] for r in rows),
            "all_clean": all(r["clean_after"] is True and r["healthy"] for r in rows)}


def _migrations(server) -> int:
    return server.health()["stages"]["ingress-0"].get("stats", {}).get("migrations", 0)


def _row(r: dict) -> str:
    return (f"{r['stage']:<14}{r['fault']:<9}{r['requests']:>9}{r['ok']:>6}{r['migrated']:>9}{r['error']:>7}"
            f"{r['aborted']:>9}{r['lost']:>6}{r['slowest_error_s']:>12}{r['back_in_s']:>9}  {r['clean_after'] is True}")


LINK = {"drop": 0.01, "corrupt": 0.02, "stall": 0.03, "stall_s": 1.0, "fault_seed": 7}


def run_link(seconds: float, clients: int) -> dict:
    """The prefill -> kv_shuttle link drops, corrupts and stalls chunks (``LINK``) under load with
    aborting and slow clients; requests time out after 20 s."""
    with serving(link_options=LINK, request_timeout_s=20) as server:
        load = faults.Load(server.url, clients=clients, abort_ratio=0.15, slow_ratio=0.2, max_tokens=10,
                           bound_s=35).start()
        time.sleep(seconds)
        load.stop()
        clean = True
        try:
            faults.settled(server, 60)
        except AssertionError as exc:
            clean = str(exc)
        counts = load.counts()
        errors = [o.seconds for o in load.outcomes if o.kind == "error"]
        return {"link": LINK, "seconds": seconds, "requests": sum(counts.values()), "migrated": _migrations(server),
                **{k: counts[k] for k in ("ok", "error", "aborted", "lost")},
                "slowest_error_s": round(max(errors, default=0.0), 2), "clean_after": clean}


def run_soak(requests: int, clients: int) -> dict:
    with serving() as server:
        warm = faults.Load(server.url, clients=clients, abort_ratio=0.3, max_tokens=8).start()
        while sum(warm.counts().values()) < 50:
            time.sleep(0.5)
        warm.stop()
        faults.settled(server)
        before = faults.footprint(server)
        started = time.monotonic()
        soak = faults.Load(server.url, clients=clients, abort_ratio=0.3, max_tokens=8, seed=1).start()
        samples = []
        while sum(soak.counts().values()) < requests:
            time.sleep(5)
            samples.append({name: f["rss_kb"] for name, f in faults.footprint(server).items()})
            print(f"  {sum(soak.counts().values())} requests; RSS MiB: "
                  + ", ".join(f"{n} {kb / 1024:.0f}" for n, kb in samples[-1].items()), flush=True)
        soak.stop()
        faults.settled(server)
        after = faults.footprint(server)
        counts = soak.counts()
        return {"requests": sum(counts.values()), **{k: counts[k] for k in ("ok", "error", "aborted", "lost")},
                "seconds": round(time.monotonic() - started, 1), "before": before, "after": after,
                "rss_samples_kb": samples,
                "rss_drift_mib": {n: round((after[n]["rss_kb"] - before[n]["rss_kb"]) / 1024, 1) for n in before}}


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--parts", default="faults,link,soak")
    parser.add_argument("--link-seconds", type=float, default=120, help="load on the faulty link (default 120)")
    parser.add_argument("--rounds", type=int, default=1, help="fault rounds over every stage (default 1)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="soak requests (default 2000)")
    parser.add_argument("--out", default="reliability.json")
    args = parser.parse_args()
    report = {}
    if "faults" in args.parts:
        print(f"{'stage':<14}{'fault':<9}{'requests':>9}{'ok':>6}{'migrated':>9}{'error':>7}{'aborted':>9}"
              f"{'lost':>6}{'slowest err':>12}{'back in':>9}  clean after")
        report["faults"] = run_faults(args.rounds, args.clients)
        f = report["faults"]
        print(f"faults: {f['faults']} injected, {f['requests']} requests, {f['lost']} lost, "
              f"clean after every one: {f['all_clean']}")
    if "link" in args.parts:
        report["link"] = k = run_link(args.link_seconds, args.clients)
        print(f"faulty link ({LINK}): {k['requests']} requests in {k['seconds']} s: {k['ok']} ok "
              f"({k['migrated']} runs again after a transient failure), {k['error']} errors "
              f"(slowest {k['slowest_error_s']} s), {k['aborted']} aborted, {k['lost']} lost; "
              f"clean after: {k['clean_after'] is True}")
    if "soak" in args.parts:
        report["soak"] = s = run_soak(args.requests, args.clients)
        print(f"soak: {s['requests']} requests in {s['seconds']} s: {s['ok']} ok, {s['aborted']} aborted, "
              f"{s['error']} errors, {s['lost']} lost; RSS drift MiB {s['rss_drift_mib']}")
    Path(args.out).write_text(json.dumps(report, indent=1))
    failed = any(report.get(part, {}).get("lost", 0) for part in ("faults", "link", "soak"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
