#!/usr/bin/env bash
# A first fidelity table of triattention, expected-attention and keydiff on the bundled SmolLM2-135M (CPU):
# GSM8K (first 10), the full cache's 256 greedy tokens replayed through each at K = 128, B = 32, fp32, one
# thread (triattention with the query centers the package ships, -o triattention.stats=bundled), beside
# h2o and streaming as references. The full recipe is ../run.sh.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/frontier/first
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli eval --model smollm2-135m --dataset gsm8k:10 \
  --policies full,triattention,expected-attention,keydiff,h2o,streaming -o triattention.stats=bundled \
  --budgets 128 --buffer 32 --max-new-tokens 256 --batch-size 10 --fidelity-only --no-progress \
  --out "$OUT/results.jsonl"
"$PY" -m reasonkv.cli report "$OUT/results.jsonl" --out "$OUT/report"
