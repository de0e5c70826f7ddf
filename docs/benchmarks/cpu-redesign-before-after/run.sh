#!/usr/bin/env bash
# The settings redesign (CacheSpec, GridSpec, the new layout) against the code before it (4745cce), side by side:
#   bench/: per-step overhead of a policy as % of a full-cache step, and tokens/s vs full, at 1024 and 2048
#     tokens (a prefill to each length evicts to K, then 128 timed decode steps), K = 512, B = 128, SmolLM2-135M
#     bf16 on one thread; the two trees run policy by policy, one after the other, so they share the load.
#   fidelity/: reasonkv eval --fidelity on gsm8k:10 at K = 128, B = 32, 256 tokens, every policy, fp32, in both
#     trees; the records must be identical but for timing (compare.py).
# BEFORE: a checkout of 4745cce (git worktree add ../before 4745cce; BEFORE=../before/src); AFTER (default src):
# the tree to compare, e.g. a checkout of the redesign's last commit.
set -u
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/benchmarks/cpu-redesign-before-after
BEFORE="${BEFORE:?a checkout of 4745cce: BEFORE=../before/src}"
POLICIES="${POLICIES:-streaming epikv snapkv h2o}"
PARTS="${PARTS:-bench fidelity}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
bench=(bench --model smollm2-135m --dtype bf16 --threads 1 --budget 512 --buffer 128 --lengths 1024,2048
  --prefill-to-length --decode-steps 128 --no-plots --no-progress)
everything=full,streaming,random,knorm,curdkv,lagkv,epikv,epikv-lag,vase-dkv,snapkv,vase-attnv,tova,h2o,raas,rkv,thinkv
eval=(eval --model smollm2-135m --dataset gsm8k:10 --budgets 128 --buffer 32 --max-new-tokens 256 --batch-size 10
  --fidelity --no-progress -o raas.protect_prompt=false --policies "$everything")
src_of() { if [[ $1 == before ]]; then echo "$BEFORE"; else echo "${AFTER:-src}"; fi; }
if [[ " $PARTS " == *" bench "* ]]; then
  for policy in $POLICIES; do
    for tree in before after; do
      PYTHONPATH=$(src_of "$tree") timeout 3600 "$PY" -m reasonkv.cli "${bench[@]}" --policies "$policy" \
        --out "$OUT/bench/$tree"
      echo "bench $policy $tree rc=$?"
    done
  done
fi
if [[ " $PARTS " == *" fidelity "* ]]; then
  mkdir -p "$OUT/fidelity"
  for tree in before after; do
    PYTHONPATH=$(src_of "$tree") timeout 9000 "$PY" -m reasonkv.cli "${eval[@]}" --out "$OUT/fidelity/$tree.jsonl"
    echo "fidelity $tree rc=$?"
    gzip -9f "$OUT/fidelity/$tree.jsonl"
  done
  "$PY" "$OUT/compare.py" "$OUT/fidelity/before.jsonl.gz" "$OUT/fidelity/after.jsonl.gz"
fi
