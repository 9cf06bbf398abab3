#!/usr/bin/env bash
# Set up everything pdflow needs, idempotently: the virtual environment in .venv, the
# dependencies, and the default model (converted once into ~/.cache/pdflow or $PDFLOW_CACHE_DIR).
# A second run checks a stamp and returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "pdflow setup: creating .venv with $($python --version)" >&2
  "$python" -m venv .venv
fi

# PDFLOW_EXTRAS: the extras to install with pdflow (scripts/test.sh adds ucx, so that the ucx
# transport's tests run rather than skip). The stamp records what was installed; a run that asks
# for a subset of it (run.sh after test.sh) installs nothing, one that asks for more installs the
# union, so alternating the README's two commands never reinstalls.
extras=${PDFLOW_EXTRAS:-test}
stamp=.venv/.pdflow-installed
sources=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
read -r stamped_sources installed < "$stamp" 2>/dev/null || true
if [ "${stamped_sources:-}" = "$sources" ]; then
  extras=$(printf '%s\n' ${installed//,/ } ${extras//,/ } | sort -u | paste -sd, -)
  missing=$(comm -13 <(printf '%s\n' ${installed//,/ } | sort -u) <(printf '%s\n' ${extras//,/ } | sort -u))
else
  missing=all
fi
if [ -n "$missing" ]; then
  echo "pdflow setup: installing dependencies into .venv (extras: $extras)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # Without a GPU, take the CPU build of torch (a pinned release lies on this machine's
    # disk); an unpinned `torch` would pull a multi-GB CUDA build. PDFLOW_TORCH overrides.
    torch_spec=${PDFLOW_TORCH:-torch==2.13.0}
    if [ -z "${PDFLOW_TORCH:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      torch_spec=torch
    fi
    .venv/bin/python -m pip install --quiet "$torch_spec"
  fi
  if ! .venv/bin/python -m pip install --quiet -e ".[$extras]"; then
    case ",$extras," in
      *,ucx,*)  # ucxx publishes wheels for some platforms and Pythons only: go on without it
        echo "pdflow setup: WARNING: installing the ucx extra failed; continuing without it" \
             "(the ucx transport's tests will skip, saying ucxx is not installed)" >&2
        extras=$(printf '%s\n' ${extras//,/ } | grep -vx ucx | paste -sd, -)
        .venv/bin/python -m pip install --quiet -e ".[$extras]" ;;
      *) exit 1 ;;
    esac
  fi
  echo "$sources $extras" > "$stamp"
fi

.venv/bin/pdflow models pull smollm2 >/dev/null
