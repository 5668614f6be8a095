#!/usr/bin/env bash
# The GPU check of issue 34 (scripts/gpu_check.py): bash scripts/gpu_check.sh OUTDIR [--tiny]
# Writes OUTDIR/gpu_check.json and OUTDIR/gpu_check.log. Runs this checkout with the machine's
# python3 (PYTHON=... to choose another), nothing installed: a lent GPU machine has torch and
# transformers but not gguf, which comes from a pure-Python wheel in .whl/ (an ignored folder:
# `pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0`, carried with the run).
set -euo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR [--tiny]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import gguf" 2>/dev/null; then
    wheel=$(ls .whl/gguf-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        echo "gguf is not installed and there is no .whl/gguf-*.whl to unpack" >&2
        exit 1
    fi
    "$python" -m zipfile -e "$wheel" .whl/site
    export PYTHONPATH=".whl/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$out" "$@"
