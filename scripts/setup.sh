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
read -r stamped_sources installed 2>/dev/null < "$stamp" || true
if [ "${stamped_sources:-}" = "$sources" ]; then
  extras=$(printf '%s\n' ${installed//,/ } ${extras//,/ } | sort -u | paste -sd, -)
  missing=$(comm -13 <(printf '%s\n' ${installed//,/ } | sort -u) <(printf '%s\n' ${extras//,/ } | sort -u))
else
  missing=all
fi
if [ -n "$missing" ]; then
  echo "pdflow setup: installing dependencies into .venv (extras: $extras)" >&2
  # uv installs what pip would (the same versions, checked with both freezes) in about half the
  # time: on the 2-core machine torch 16 s against 37, the rest 27 s against 59. Bytecode is
  # compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else would,
  # and every process would compile what it imports. uv reads no pip configuration: pip's
  # find-links (where this machine keeps its torch wheel) are handed to it. Without uv, pip.
  install=(.venv/bin/python -m pip install --quiet)
  if .venv/bin/python -m pip install --quiet uv >/dev/null 2>&1 && [ -x .venv/bin/uv ]; then
    install=(.venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode)
    for links in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null); do
      [ -d "$links" ] && install+=(--find-links "$links")
    done
  else
    .venv/bin/python -m pip install --quiet --upgrade pip
  fi
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # Without a GPU, take the CPU build of torch (a pinned release lies on this machine's
    # disk); an unpinned `torch` would pull a multi-GB CUDA build. PDFLOW_TORCH overrides.
    torch_spec=${PDFLOW_TORCH:-torch==2.13.0}
    if [ -z "${PDFLOW_TORCH:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      torch_spec=torch
    fi
    "${install[@]}" "$torch_spec"
  fi
  if ! "${install[@]}" -e ".[$extras]"; then
    case ",$extras," in
      *,ucx,*)  # ucxx publishes wheels for some platforms and Pythons only: go on without it
        echo "pdflow setup: WARNING: installing the ucx extra failed; continuing without it" \
             "(the ucx transport's tests will skip, saying ucxx is not installed)" >&2
        extras=$(printf '%s\n' ${extras//,/ } | grep -vx ucx | paste -sd, -)
        "${install[@]}" -e ".[$extras]" ;;
      *) exit 1 ;;
    esac
  fi
  echo "$sources $extras" > "$stamp"
fi

# pdflow's own bytecode, compiled now (in a second where it is up to date): the editable install
# leaves it to each process, and where PYTHONDONTWRITEBYTECODE is set none keeps what it compiled,
# so every stage's fork server compiled pdflow again (its imports took 2.6-3.2 s of CPU, 2.2 s
# with this). A source edited later is compiled in memory until the next run of this script.
.venv/bin/python -m compileall -q pdflow >/dev/null

.venv/bin/pdflow models pull smollm2 >/dev/null

# pdflow's C kernels, built here once (cached under the model cache's kernels/), so that a host
# without a working C compiler with OpenMP hears it now rather than from a stage's log. Measured
# on the 2-core machine (`pdflow bench engine`, with and without PDFLOW_NO_KERNELS): the default
# int4 weights' decode step 3.4 ms with the kernels, 201 ms without; fp32 weights 27.5 ms.
no_kernels=$(.venv/bin/python -c 'from pdflow import kernels; kernels.library(); print(kernels.unavailable_reason() or "")' 2>/dev/null)
if [ -n "$no_kernels" ]; then
  echo "pdflow setup: WARNING: pdflow's C kernels cannot be built ($no_kernels). The default int4" \
       "weights then fall back to PyTorch dequantizing them on every call: a decode step about 60x" \
       "slower (201 ms against 3.4 ms at batch 1 on a 2-core machine), prefill about 1.5x. Install" \
       "a C compiler with OpenMP (Debian/Ubuntu: apt install gcc; or name one in \$CC), or serve fp32" \
       "weights (--set model.weights='\"fp32\"': 8x the kernels' step, 5x the memory)." >&2
fi
