#!/usr/bin/env bash
# Fetch, here, the wheels that scripts/device_check.sh installs on the GPU machine (Python 3.12,
# x86-64): pdflow's dependencies that its image lacks (it has torch, transformers, uvloop, xxhash,
# httpx, pytest), with the versions their own requirements pin. They land in .whl/, which git
# ignores and the device tool carries (64 MiB a call).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  msgspec pyzmq structlog pytest-asyncio pytest-timeout fastapi uvicorn openai \
  2> >(grep -v "^WARNING: Location" >&2)
du -sh .whl
