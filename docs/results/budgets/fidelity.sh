#!/usr/bin/env bash
# Fidelity to the full cache under each allocation at equal bytes (a small CPU run): SmolLM2-135M, GSM8K (first
# 12), 128 greedy tokens of the full cache replayed through h2o and snapkv at K = 64, B = 16, under uniform,
# pyramid, adaptive and calibrated (all hold the same measured K/V bytes). Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/budgets
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The calibrated allocation's weights: attention mass beyond 4 sinks and 64 recent keys, measured on MATH-500
# reference solutions (not the GSM8K problems replayed below).
"$PY" -m reasonkv.cli calibrate --budgets --model smollm2-135m --dataset math500 --traces 16 \
  --max-trace-tokens 384 --out "$OUT/smollm2-135m-budgets.json"
"$PY" -m reasonkv.cli eval --model smollm2-135m --dataset gsm8k:12 --policies full,h2o,snapkv \
  --budgets 64 --buffer 16 --allocations uniform,pyramid,adaptive,calibrated \
  --budgets-file "$OUT/smollm2-135m-budgets.json" --max-new-tokens 128 --batch-size 8 \
  --fidelity-only --no-progress --out "$OUT/fidelity.jsonl"
"$PY" -m reasonkv.cli report "$OUT/fidelity.jsonl" --out "$OUT/fidelity-report"
# Paired differences of each allocation against its policy's uniform cache (and the other policy), by problem.
"$PY" -m reasonkv.cli.paired "$OUT/fidelity.jsonl" --against h2o --out "$OUT/paired-h2o.md"
"$PY" -m reasonkv.cli.paired "$OUT/fidelity.jsonl" --against snapkv --out "$OUT/paired-snapkv.md"
