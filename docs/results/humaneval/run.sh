#!/usr/bin/env bash
# HumanEval (first 20) on the bundled SmolLM2-135M, each completion's tests run in the sandbox: the full
# cache against streaming and h2o at K = 64, B = 32, 384 greedy tokens, fp32, one CPU thread.
# Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/humaneval
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli eval --model smollm2-135m --dataset humaneval:20 --allow-code-execution \
  --policies full,streaming,h2o --budgets 64 --buffer 32 --max-new-tokens 384 --batch-size 20 \
  --no-progress --out "$OUT/results.jsonl"
"$PY" -m reasonkv.cli report "$OUT/results.jsonl" --out "$OUT/report"
