#!/usr/bin/env bash
# full / streaming / epikv / snapkv / h2o in their steady state at 1024 and 2048 tokens (K = 512,
# B = 128, SmolLM2-135M fp32, one thread): the code before this change set (b28c5f2) and after it,
# back to back, twice.
set -u
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/benchmarks/cpu-step-before-after
BEFORE="${BEFORE:?a checkout of b28c5f2: git worktree add ../before b28c5f2, then BEFORE=../before/src}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for round in 1 2; do
for tree in before after; do
  src=src; [[ $tree == before ]] && src="$BEFORE"
  PYTHONPATH=$src timeout 1500 $PY -m reasonkv.cli bench --model smollm2-135m --dtype fp32 --threads 1 \
    --policies full,streaming,epikv,snapkv,h2o --budget 512 --buffer 128 --lengths 1024,2048 --prefill-to-length \
    --decode-steps 64 --no-plots --no-progress --out "$OUT/$tree-$round"
  echo "$tree $round rc=$?"
done
done
