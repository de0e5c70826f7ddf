#!/usr/bin/env bash
# The HumanEval grid: the first 40 problems on both bundled models (MODELS="smollm2-135m" picks one),
# every completion's hidden tests run in the sandbox; the full cache against streaming, h2o, snapkv,
# vase-attnv and epikv at K = 128 and 256 (and epikv with a recent window at K = 128), with fidelity
# replays of the full cache's traces. 384 greedy tokens, fp32, one CPU thread. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/humaneval/grid
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for MODEL in ${MODELS:-smollm2-135m gemma3-270m}; do
  "$PY" -m reasonkv.cli eval --model "$MODEL" --dtype fp32 --dataset humaneval:40 --allow-code-execution \
    --policies full,streaming,h2o,snapkv,vase-attnv,epikv --budgets 128,256 --buffer 32 \
    --max-new-tokens 384 --batch-size 20 --fidelity --no-progress --out "$OUT/$MODEL.jsonl"
  # EPIKV protects no recent tokens by default, and most prompts here are longer than K + B = 160: the same
  # cell with a recent window of 32.
  "$PY" -m reasonkv.cli eval --model "$MODEL" --dtype fp32 --dataset humaneval:40 --allow-code-execution \
    --policies epikv -o epikv.window=32 --budgets 128 --buffer 32 \
    --max-new-tokens 384 --batch-size 20 --fidelity --no-progress --out "$OUT/$MODEL.jsonl"
  "$PY" -m reasonkv.cli report "$OUT/$MODEL.jsonl" --out "$OUT/$MODEL-report"
done
