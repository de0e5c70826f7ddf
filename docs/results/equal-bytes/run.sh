#!/usr/bin/env bash
# Fidelity to the full cache at equal K/V bytes, on the bundled SmolLM2-135M (head_dim 64), in fp32:
# K full-precision tokens per head, against K/2 of them plus an int8 or int4 tier holding the other
# half of the bytes. In fp32 a token's K/V take 512 bytes per (layer, kv-head), an int8 one 162 and
# an int4 one 98 (codes, scales and zero points in fp32, key-group id; reasonkv.tiers.quantized_token_bytes):
#
#   bytes of 128 tokens:  128 full  |  64 full + 202 int8  |  64 full + 334 int4
#   bytes of 256 tokens:  256 full  | 128 full + 404 int8  | 128 full + 668 int4
#
# fp32, not bf16: on this CPU (no bf16 instructions) bf16 matrix products take 3.6x as long.
# GSM8K (first 40) and MATH-500 (first 20), greedy, 512 new tokens, B = 32, fidelity only (the full
# cache's own greedy outputs are the traces). Resumable: rerun to continue. One torch thread.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/equal-bytes
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
common=(--model smollm2-135m --dtype fp32 --dataset gsm8k:40,math500:20 --buffer 32 --max-new-tokens 512
  --batch-size 32 --fidelity-only --no-progress --out "$OUT/results.jsonl")
policies=streaming,snapkv,vase-attnv,vase-dkv,epikv,h2o

# the bytes of 128 tokens, then of 256
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "full,$policies" --budgets 128
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "$policies" --budgets 64 --quantized 202 --bits 8
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "$policies" --budgets 64 --quantized 334 --bits 4
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "$policies" --budgets 256
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "$policies" --budgets 128 --quantized 404 --bits 8
"$PY" -m reasonkv.cli eval "${common[@]}" --policies "$policies" --budgets 128 --quantized 668 --bits 4
"$PY" -m reasonkv.eval.equal_bytes "$OUT/results.jsonl" --out "$OUT"
