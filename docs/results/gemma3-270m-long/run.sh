#!/usr/bin/env bash
# Fidelity on the bundled Gemma 3 270M past its sliding window: 1152 greedy tokens of the full cache, so
# that prompt + trace (about 1,200 tokens) run well beyond the 512 tokens its 15 sliding layers keep,
# replayed through each evicting cache (its 3 full-attention layers evicted to K after every B = 16).
# GSM8K (first 4) as completions, fp32, one CPU thread, fidelity only. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/gemma3-270m-long
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli eval --model gemma3-270m --dtype fp32 --dataset gsm8k:4 \
  --policies full,streaming,h2o,epikv --budgets 64,256 --buffer 16 --max-new-tokens 1152 \
  --batch-size 4 --fidelity-only --no-progress --out "$OUT/results.jsonl"
"$PY" -m reasonkv.cli report "$OUT/results.jsonl" --out "$OUT/report"
