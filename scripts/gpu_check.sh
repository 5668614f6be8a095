#!/usr/bin/env bash
# The GPU check of issue 34 (scripts/gpu_check.py): bash scripts/gpu_check.sh OUTDIR [--tiny]
# Writes OUTDIR/gpu_check.json and OUTDIR/gpu_check.log. Runs this checkout with the machine's
# python3 (PYTHON=... to choose another), nothing installed: a lent GPU machine has torch and
# transformers but maybe not gguf, llguidance or jinja2, which come from wheels in .whl/ (an ignored
# folder, carried with the run: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 llguidance==1.9.1
# jinja2==3.1.6 markupsafe==3.0.2`, the GPU machine's Python); each is unpacked only where its module is missing.
set -euo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR [--tiny]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
for module in gguf llguidance jinja2 markupsafe; do
    if ! "$python" -c "import $module" 2>/dev/null; then
        wheel=$(ls .whl/"$module"-*.whl 2>/dev/null | head -n 1 || true)
        if [ -z "$wheel" ]; then
            echo "$module is not installed and there is no .whl/$module-*.whl to unpack" >&2
            exit 1
        fi
        "$python" -m zipfile -e "$wheel" .whl/site
    fi
done
if [ -d .whl/site ]; then
    export PYTHONPATH=".whl/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$out" "$@"
