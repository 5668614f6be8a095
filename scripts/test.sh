#!/usr/bin/env bash
# Install everything, then run the whole test suite (the slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -m "slow or not slow" "$@"
