#!/usr/bin/env bash
# Install everything, then the main job: plain vs speculative decoding (the default --spec ngram:
# prompt lookup) of the default model on the same input-grounded prompt, printing the measured speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
prompt='Fix the spelling mistakes in this paragraph and return the corrected paragraph only:

The quick brown fox jumpd over the lazy dog. Every morning the fox went to the river to drink watter, and every evening it returned to its den in the forrest. The dog, who lived on a farm nearby, never undrestood why the fox was always in such a hurry.'
exec .venv/bin/quickdraft generate --compare -n 128 --chat "$prompt" "$@"
