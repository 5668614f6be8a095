#!/usr/bin/env bash
# Install everything, then run the main job on the default model (SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/quickdraft generate --chat "Explain in three sentences why the sky is blue." -n 96 "$@"
