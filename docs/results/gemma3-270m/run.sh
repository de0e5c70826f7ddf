#!/usr/bin/env bash
# Fidelity to the full cache on the bundled Gemma 3 270M (a hybrid: 15 sliding-window layers of 512
# tokens and 3 full-attention layers), in fp32 on one CPU thread: the budget K and the buffer B apply
# to the full-attention layers, the sliding layers keep their window. GSM8K (first 20), completion-style
# prompts (a base model: no chat template), 128 greedy tokens of the full cache replayed through each
# evicting cache (fidelity only). Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/gemma3-270m
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli eval --model gemma3-270m --dtype fp32 --dataset gsm8k:20 \
  --policies full,streaming,h2o,tova,epikv --budgets 32,64 --buffer 16 --max-new-tokens 128 \
  --batch-size 10 --fidelity-only --no-progress --out "$OUT/results.jsonl"
"$PY" -m reasonkv.cli report "$OUT/results.jsonl" --out "$OUT/report"
