#!/usr/bin/env bash
# Install everything, then the main job: plain vs speculative decoding (the default --spec ngram:
# prompt lookup) of the default model on the same prompt, interleaved rounds, printing the measured
# speedup (or that there is none to claim) and whether the greedy outputs are identical.
# The task is one the 135M model does well (a small class: its code repeats its own names, which is
# where prompt lookup drafts); it cannot reliably edit a given text (fix spelling, reformat a table).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
prompt='Write a Python class Stack with the methods push, pop, peek and is_empty, using a list.'
exec .venv/bin/quickdraft generate --compare -n 200 --chat "$prompt" "$@"
