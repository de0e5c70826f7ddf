#!/usr/bin/env bash
# The allocations' fidelity at equal capacity (the issue's table), replaying the full cache's greedy traces.
#
# SmolLM2-135M at the frontier table's settings: GSM8K 40 + MATH-500 20, 512 new tokens at most, K = 128, B = 32,
# bf16, batch 32; h2o, snapkv, vase-attnv and triattention, under uniform, pyramid, adaptive and calibrated
# (smollm2-135m-budgets.json: attention mass measured on MATH-500 reference solutions, not the replayed problems).
# triattention chooses per layer and kv-head here: its default, one set per kv head for every layer, cannot take
# per-layer budgets and is refused; that default runs under uniform only, as an eviction row of ../selection.
# Two files, so that two processes can run at once
# (one torch thread each).
#
# Gemma 3 270M at the frontier table's settings: GSM8K 20, 640 tokens (past its 512-token window), K = 64 of its
# 3 full-attention layers, B = 16, fp32; h2o under uniform, pyramid and calibrated. adaptive is the uniform
# cache on this model (one kv head per layer: tested), so it is not run.
#
# The full cache's traces are those of ../frontier/, copied in before the first run (without them eval generates
# them again, the same tokens). Every allocation has the uniform cache's capacity; each record's
# kv_bytes_held_per_step is what it held, measured. bench.sh measures the bytes per layer and the step cost of
# ragged storage. Resumable: rerun to continue (eval appends and skips what is done).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/budgets
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
ALL=uniform,pyramid,adaptive,calibrated
BOTH=gsm8k:40,math500:20
for model in smollm2-135m gemma3-270m; do
  [ -f "$OUT/$model-budgets.json" ] || "$PY" -m reasonkv.cli calibrate --budgets --model "$model" \
    --dataset math500 --traces 16 --max-trace-tokens 384 --out "$OUT/$model-budgets.json"
done
smollm2() {  # smollm2 FILE POLICY DATASETS ALLOCATIONS [OPTIONS...]
  local file="$OUT/$1" policy="$2" datasets="$3" allocations="$4"
  shift 4
  local calibrated=()
  [[ "$allocations" == *calibrated* ]] && calibrated=(--budgets-file "$OUT/smollm2-135m-budgets.json")
  [ -f "$file" ] || "$PY" docs/results/full_traces.py docs/results/frontier/smollm2-135m.jsonl "$file"
  "$PY" -m reasonkv.cli eval --model smollm2-135m --policies "full,$policy" "$@" --dataset "$datasets" \
    --allocations "$allocations" "${calibrated[@]}" --budgets 128 --buffer 32 --max-new-tokens 512 \
    --batch-size 32 --dtype bf16 --fidelity-only --no-progress --out "$file"
}
(
  smollm2 smollm2-frontier-2.jsonl h2o "$BOTH" "$ALL"
  smollm2 smollm2-frontier-2.jsonl vase-attnv "$BOTH" "$ALL"
) &
TRI=(-o triattention.stats=bundled)
smollm2 smollm2-frontier.jsonl triattention "$BOTH" uniform "${TRI[@]}"
smollm2 smollm2-frontier.jsonl snapkv "$BOTH" "$ALL"
smollm2 smollm2-frontier.jsonl triattention "$BOTH" "$ALL" "${TRI[@]}" -o triattention.selection=per-layer-head
wait
[ -f "$OUT/gemma3-270m.jsonl" ] || "$PY" docs/results/full_traces.py docs/results/frontier/gemma3-270m.jsonl "$OUT/gemma3-270m.jsonl"
"$PY" -m reasonkv.cli eval --model gemma3-270m --dtype fp32 --dataset gsm8k:20 --policies full,h2o --budgets 64 \
  --buffer 16 --allocations uniform,pyramid,calibrated --budgets-file "$OUT/gemma3-270m-budgets.json" \
  --max-new-tokens 640 --batch-size 10 --fidelity-only --no-progress --out "$OUT/gemma3-270m.jsonl"
SMOLLM2=("$OUT/smollm2-frontier.jsonl" "$OUT/smollm2-frontier-2.jsonl")
"$PY" -m reasonkv.cli report "${SMOLLM2[@]}" --out "$OUT/frontier-report" > /dev/null
"$PY" -m reasonkv.cli report "$OUT/gemma3-270m.jsonl" --out "$OUT/gemma3-report" > /dev/null
"$PY" "$OUT/summarise.py" "$OUT/summary.md" "${SMOLLM2[@]}" "$OUT/gemma3-270m.jsonl"
