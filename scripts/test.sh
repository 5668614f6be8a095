#!/usr/bin/env bash
# Install everything, then run the whole test suite (the slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the lint first: a few seconds, and an unsorted import or an unbound loop variable fails the run
.venv/bin/ruff check quickdraft tests scripts
exec .venv/bin/python -m pytest -m "slow or not slow" "$@"
