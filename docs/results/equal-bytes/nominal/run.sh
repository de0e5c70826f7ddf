#!/usr/bin/env bash
# Made the files of this folder at commit 696d52b (then with OUT=docs/results/equal-bytes, module names since renamed); kept
# as the record of the comparison at NOMINAL bytes. ../run.sh is the comparison at measured bytes.
# Fidelity to the full cache at equal K/V bytes, on the bundled SmolLM2-135M (head_dim 64), in fp32:
# K full-precision tokens per head, against K/2 of them plus an int8 or int4 tier holding the other
# half of the bytes. In fp32 a token's K/V take 512 bytes per (layer, kv-head), an int8 one 162 and
# an int4 one 98 (codes, scales and zero points in fp32, key-group id; reasonkv.cache.tiers.quantized_token_bytes):
#
#   bytes of 32 tokens:  32 full  |  16 full + 50 int8  |  16 full + 83 int4
#   bytes of 64 tokens:  64 full  |  32 full + 101 int8 |  32 full + 167 int4
#
# Sized for two CPU cores and about an hour: GSM8K (first 12) and MATH-500 (first 6), 128 greedy
# tokens of the full cache replayed through each evicting cache (fidelity only), B = 16, so that
# budgets of 32 and 64 tokens evict several times per trace; SnapKV and VASE-AttnV observe (and
# protect) the last 8 queries instead of 32. fp32, not bf16: on a CPU without bf16
# instructions bf16 matrix products take 3.6x as long. Resumable: rerun to continue. One torch thread.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/equal-bytes/nominal
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
common=(--model smollm2-135m --dtype fp32 --dataset gsm8k:12,math500:6 --buffer 16 --max-new-tokens 128
  --batch-size 32 --fidelity-only --no-progress
  -o snapkv.window=8 -o vase-attnv.window=8)  # their default observation window (32) would not fit K = 16
policies=streaming,snapkv,vase-attnv,vase-dkv,epikv,h2o

# The bytes of 32 tokens (results.jsonl), then of 64 (results-64.jsonl); `run.sh 32` or `run.sh 64`
# runs one of the two groups (one per core), `run.sh` both, then the table and the plots.
group="${1:-all}"
if [[ "$group" == 32 || "$group" == all ]]; then
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results.jsonl" --policies "full,$policies" --budgets 32
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results.jsonl" --policies "$policies" --budgets 16 \
    --quantized 50 --bits 8
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results.jsonl" --policies "$policies" --budgets 16 \
    --quantized 83 --bits 4
fi
if [[ "$group" == 64 || "$group" == all ]]; then
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results-64.jsonl" --policies "full,$policies" --budgets 64
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results-64.jsonl" --policies "$policies" --budgets 32 \
    --quantized 101 --bits 8
  "$PY" -m reasonkv.cli eval "${common[@]}" --out "$OUT/results-64.jsonl" --policies "$policies" --budgets 32 \
    --quantized 167 --bits 4
fi
if [[ -f "$OUT/results.jsonl" && -f "$OUT/results-64.jsonl" ]]; then
  "$PY" -m reasonkv.cli.equal_bytes "$OUT/results.jsonl" "$OUT/results-64.jsonl" --out "$OUT"
fi
