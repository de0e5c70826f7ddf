#!/usr/bin/env bash
# Every policy before (b28c5f2: per-step attention readers, the dense R-KV similarity, ThinKV's K-means per
# segment) and after. One process runs both trees policy by policy; this folder was made with two processes at
# once, one tree each (TREES=before and TREES=after, one core each), see README.md:
#   bench/: the steady state at 1024 / 2048 / 4096 / 8192 tokens (a prefill to each length evicts to K, then
#     128 timed decode steps: one whole eviction cycle), K = 512, B = 128, SmolLM2-135M bf16 on one thread,
#     and one eviction at 4096 cached tokens; after/ also measures transformers' own cache (--transformers-cache).
#   fidelity/: reasonkv eval --fidelity on gsm8k:10 at K = 128, B = 32, every policy, fp32 (the default), in
#     three trees: before, start (9e6e851, where this change set began: ties broken by position and keyed
#     noise had landed since b28c5f2) and after. RaaS runs with protect_prompt=false (its default keeps
#     whole prompts, longer than K here).
# A rerun resumes: finished entries and records are skipped. POLICIES picks some; PARTS="bench" or "fidelity";
# TREES picks trees (the fidelity replays have no timing: two processes may share the CPU, one tree each).
set -u
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/benchmarks/cpu-overhead-before-after
BEFORE="${BEFORE:?a checkout of b28c5f2: git worktree add ../before b28c5f2, then BEFORE=../before/src}"
POLICIES="${POLICIES:-streaming random knorm curdkv lagkv epikv epikv-lag vase-dkv snapkv vase-attnv tova h2o raas rkv thinkv}"
PARTS="${PARTS:-bench fidelity}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
bench=(bench --model smollm2-135m --dtype bf16 --threads 1 --budget 512 --buffer 128 --lengths 1024,2048,4096,8192
  --prefill-to-length --decode-steps 128 --eviction-cost --cached 4096 --repeats 3 --no-plots --no-progress)
eval=(eval --model smollm2-135m --dataset gsm8k:10 --budgets 128 --buffer 32 --max-new-tokens 256 --batch-size 10
  --fidelity --no-progress -o raas.protect_prompt=false)
src_of() {
  case $1 in
    before) echo "$BEFORE" ;;
    start) echo "${START:?a checkout of 9e6e851 for the fidelity tree start: START=../start/src}" ;;
    *) echo src ;;
  esac
}
if [[ " $PARTS " == *" bench "* ]]; then
  for policy in $POLICIES; do
    for tree in ${TREES:-before after}; do
      extra=(); [[ $tree == after ]] && extra=(--transformers-cache)
      PYTHONPATH=$(src_of "$tree") timeout 3600 "$PY" -m reasonkv.cli "${bench[@]}" "${extra[@]}" --policies "$policy" \
        --out "$OUT/bench/$tree"
      echo "bench $policy $tree rc=$?"
    done
  done
fi
if [[ " $PARTS " == *" fidelity "* ]]; then
  mkdir -p "$OUT/fidelity"
  for tree in ${TREES:-before start after}; do
    PYTHONPATH=$(src_of "$tree") timeout 7200 "$PY" -m reasonkv.cli "${eval[@]}" --policies "full,${POLICIES// /,}" \
      --out "$OUT/fidelity/$tree.jsonl"
    echo "fidelity $tree rc=$?"
  done
fi
