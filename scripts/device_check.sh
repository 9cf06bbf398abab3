#!/usr/bin/env bash
# The GPU checks of device memory on the data plane, in one run on the device machine (one H200,
# Python 3.12 with a CUDA torch). Prepare here first: scripts/device_wheels.sh (pdflow's other
# dependencies as wheels, in .whl/), then call the device tool with carry [".whl"] and
#   bash scripts/device_check.sh
# It runs: the conformance suite's memory-kind cases and the staging tests (CUDA cases included),
# the end-to-end test with prefill and decode on cuda when the model is there (the converted
# SmolLM2 is 517 MB: more than a call carries; PDFLOW_CACHE_DIR names where it is), and
# scripts/device_bench.py (staged copies against torch's own device-to-device copy).
# Logs and figures go to $OUT (else ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee -a "$out/gpu.txt"
status=0
python3 -m pytest -q -rs -p no:cacheprovider tests/test_staging.py tests/test_transports.py \
  -k "test_staging or memory_kinds" 2>&1 \
  | tee "$out/tests.log" || status=1
if python3 -c "import sys; from pdflow.models import is_pulled; sys.exit(not is_pulled('smollm2'))"; then
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_e2e_device.py 2>&1 | tee "$out/e2e.log" || status=1
else
  echo "e2e on cuda: skipped, the model is not on this machine (pdflow models pull needs the package registry)" \
    | tee "$out/e2e.log"
fi
python3 scripts/device_bench.py --json "$out/device_bench.json" 2>&1 | tee "$out/device_bench.log" || status=1
exit $status
