#!/usr/bin/env bash
# The tests that lean on transformers (tokenizers, the reference forward and generate(), GGUF
# files read by transformers' GGUF reader, weight formats, end to end), at each end of the range
# pyproject.toml accepts: each version is installed beside .venv's own (pip --target, put first on
# PYTHONPATH for the tests and the stages they start), so .venv keeps its pinned set.
#   scripts/test_transformers_range.sh                # the lower bound and the newest release
#   scripts/test_transformers_range.sh 5.20.2 5.25.0  # any versions
# Not part of scripts/test.sh: it takes about 3 minutes, beyond CI's 10-minute budget (see README,
# "Dependencies").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
lower=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  newest=$(.venv/bin/python -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
  versions=("$lower" "${newest:?cannot read the newest transformers from the package index}")
fi
tests=(tests/test_tokenizer_loading.py tests/test_engine.py tests/test_e2e_models_by_path.py tests/test_models.py
       tests/test_weights.py tests/test_e2e.py tests/test_logits_processors.py tests/test_migration.py)
for version in "${versions[@]}"; do
  target=.venv/transformers-$version
  if [ ! -d "$target/transformers" ]; then
    .venv/bin/python -m pip install --quiet --target "$target" "transformers==$version" 2>&1 \
      | grep -v "dependency resolver\|requires transformers" >&2 || true
  fi
  echo "transformers $version:" >&2
  PYTHONPATH="$PWD/$target" .venv/bin/python -m pytest -q -n "$(( $(nproc) + 1 ))" --dist loadfile \
    -p no:cacheprovider "${tests[@]}"
done
