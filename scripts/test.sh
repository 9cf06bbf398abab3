#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extras, plus ucx (ucxx, about 220 MB, no GPU needed) so that its transport is tested,
# and ray (about 240 MB installed) so that the Ray backend runs on a real Ray cluster.
PDFLOW_EXTRAS=${PDFLOW_EXTRAS:-test,ucx,ray} scripts/setup.sh
# The suite runs in PDFLOW_TEST_WORKERS processes (pytest-xdist; 0: in this one), a module to a
# worker at a time (--dist loadfile), so that a module's servers are started once (tests/conftest.py
# makes one unit of the modules that share a session server few others use, and hands the longest
# units out first). One worker more than there are cores: much of an end-to-end test is waiting (a
# server starting, a heartbeat, a timeout), which another worker fills. On the 2-core machine, once
# (a smaller suite): 722 s in one process, 543 s in 2 workers, 436 s in 3; on 2026-12-07, 1,331
# tests in 3 workers: 513 s with 1,001 s of CPU (/proc/stat); then 432 s with 833 s (and 442-474 s in
# three more runs) once the tests' HTTP calls shared one client (pdflow.testing.local_http); then
# 430.8 s and 473.5 s in two clean clones (488.6 s before; the machine's speed varies by half)
# once ingress stopped importing transformers and `pdflow run` building the bench commands' arguments.
# Two more than the cores (4 workers), 2026-12-08: 427.7 s and 420.5 s with 842 s and 828 s of CPU,
# against 395.7 s with 749 s in 3 between them (idle 8 s against 40 s): a fourth worker's collection
# and the contention cost more than the idle time it fills.
workers=${PDFLOW_TEST_WORKERS:-$(( $(nproc) + 1 ))}
# The plug-ins the suite uses, named rather than found: pytest rewrites the asserts of every module
# of every installed plug-in's package (schemathesis, hypothesis and anyio ship plug-ins the suite
# does not use: 263 modules), again in each process where PYTHONDONTWRITEBYTECODE keeps it from
# caching them. Collecting took 16.5 s of CPU in each worker, 11.2 s with this. Each is named by its
# module, not its entry point's name: pytest rewrites the asserts of the package a -p names, and
# "-p asyncio" had it rewrite the standard library's asyncio (29 modules, again in each process, and
# slower asserts in the event loop of every in-process pipeline): collecting, 10.7 s -> 9.3 s of CPU.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), no process caches pdflow's
# bytecode, so each of the suite's processes that import it (over 100) compiled its modules again
# (about 0.1 s of CPU each; a worker's collection 9.7 -> 8.7 s). Compiled once here, in 0.3 s.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q pdflow || true
plugins=(-p xdist.plugin -p pytest_asyncio.plugin -p pytest_timeout)
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "${plugins[@]}" "$@"
fi
exec .venv/bin/python -m pytest "${plugins[@]}" -n "$workers" --dist loadfile "$@"
