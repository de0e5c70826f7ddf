#!/usr/bin/env bash
# Fidelity to the full cache at equal measured K/V bytes, on the bundled SmolLM2-135M (head_dim 64), in fp32:
# K full-precision tokens per head, against K/2 of them plus an int8 or an int4 tier whose measured bytes
# fill the other half. The bytes are what the rows held right after each eviction (steady_kv_tokens in
# the records: full-precision tokens per layer and kv-head), not the tier's nominal bytes: its pending
# tokens wait at full precision (512 bytes each here) until a whole key group of 32 forms, and key
# groups that lose members cost more per member. So Q is measured, per policy and format:
#
#   1. calibration.jsonl: each tiered policy at two Q (first 3 GSM8K problems); the Q that fills the
#      budget comes from the line through the two measurements (python -m reasonkv.cli.equal_bytes
#      --size-for), rounded down, and is at least 32 (a tier holds at least one key group);
#   2. results.jsonl (bytes of 32 tokens: 32 full | 16 full + Q) and results-64.jsonl (bytes of 64:
#      64 full | 32 full + Q), GSM8K (first 12) and MATH-500 (first 6). Beside 16 full-precision tokens
#      even the smallest tier (Q = 32) measures more than 32 tokens' bytes for most policies (its pending
#      tokens alone take up to 31), so the bytes of 32 also get plain cells at K = 40, above every tier;
#   3. the tables and plots (python -m reasonkv.cli.equal_bytes).
#
# 128 greedy tokens of the full cache replayed through each evicting cache (fidelity only), B = 16, so
# that these budgets evict several times per trace; SnapKV and VASE-AttnV observe (and protect) the last
# 8 queries instead of 32. fp32, not bf16: on a CPU without bf16 instructions bf16 matrix products take
# 3.6x as long. Resumable: rerun to continue. One torch thread. `run.sh 32` or `run.sh 64` runs one of
# the two byte budgets (after the calibration), `run.sh` both.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/equal-bytes
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
common=(--model smollm2-135m --dtype fp32 --buffer 16 --max-new-tokens 128 --batch-size 32 --fidelity-only --no-progress)
windows=(-o snapkv.window=8 -o vase-attnv.window=8)  # their default observation window (32) would not fit K = 16
window_of() {  # $1: a policy; prints its window option if it has one (eval refuses options of unselected policies)
  case "$1" in snapkv | vase-attnv) echo "-o $1.window=8" ;; esac
}
data=(--dataset gsm8k:12,math500:6)
policies=(streaming snapkv vase-attnv vase-dkv epikv h2o)
all=$(IFS=,; echo "${policies[*]}")

# 1. Calibration: Q = 32 and 64 beside K = 16, Q = 64 and 128 beside K = 32, for int8 and int4.
calibration=("${windows[@]}" --dataset gsm8k:3 --out "$OUT/calibration.jsonl")
"$PY" -m reasonkv.cli eval "${common[@]}" "${calibration[@]}" --policies full,snapkv,vase-attnv --budgets 16
for bits in 8 4; do
  for q in 32 64; do
    "$PY" -m reasonkv.cli eval "${common[@]}" "${calibration[@]}" --policies "$all" --budgets 16 --quantized "$q" \
      --bits "$bits"
  done
  for q in 64 128; do
    "$PY" -m reasonkv.cli eval "${common[@]}" "${calibration[@]}" --policies "$all" --budgets 32 --quantized "$q" \
      --bits "$bits"
  done
done

# 2. Each byte budget: the plain cells, then every policy's tier at the Q its measured bytes allow.
run_budget() {  # $1: the byte budget in tokens, $2: its results file, $3: the plain budgets
  local tokens=$1 results=$2 plain=$3 half=$(($1 / 2))
  "$PY" -m reasonkv.cli eval "${common[@]}" "${windows[@]}" "${data[@]}" --out "$results" --policies "full,$all" \
    --budgets "$plain"
  "$PY" -m reasonkv.cli.equal_bytes "$OUT/calibration.jsonl" --size-for "$tokens" |
    while read -r policy bits budget quantized; do
      [[ "$budget" == "$half" ]] || continue
      # shellcheck disable=SC2046  # the window option splits into its two words
      "$PY" -m reasonkv.cli eval "${common[@]}" $(window_of "$policy") "${data[@]}" --out "$results" --policies "$policy" \
        --budgets "$half" --quantized "$((quantized < 32 ? 32 : quantized))" --bits "$bits" </dev/null
    done
}
group="${1:-all}"
if [[ "$group" == 32 || "$group" == all ]]; then
  run_budget 32 "$OUT/results.jsonl" 32,40
fi
if [[ "$group" == 64 || "$group" == all ]]; then
  run_budget 64 "$OUT/results-64.jsonl" 64
fi

# 3. The tables and plots.
if [[ -f "$OUT/results.jsonl" && -f "$OUT/results-64.jsonl" ]]; then
  "$PY" -m reasonkv.cli.equal_bytes "$OUT/results.jsonl" "$OUT/results-64.jsonl" --out "$OUT"
fi
