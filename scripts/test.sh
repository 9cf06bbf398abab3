#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extras, plus ucx (ucxx, about 220 MB, no GPU needed) so that its transport is tested,
# and ray (about 240 MB installed) so that the Ray backend runs on a real Ray cluster.
PDFLOW_EXTRAS=${PDFLOW_EXTRAS:-test,ucx,ray} scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
