#!/usr/bin/env bash
# Quick start: set up (idempotent) and serve the default topology. Extra arguments go to
# `pdflow run`, e.g. `scripts/run.sh --log-format json`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pdflow run "${PDFLOW_TOPOLOGY:-topology.toml}" "$@"
