#!/usr/bin/env bash
# Selection against eviction on SmolLM2-135M (CPU): the gate this package ships, fidelity at the frontier table's
# settings, and HumanEval against VASE.
#
# 1. The seer gate (the authors' gate: RMSNorm on q and k, 128 channels, N(0, 0.02)): self-distillation on the
#    model's own answers to GSM8K problems, sampled at temperature 0.6 (up to 384 new tokens, 32 at a time) and
#    packed into sequences of at least 2,048 tokens; 4 to train on, 1 held out; the loss at 64 query positions
#    in each sequence's later half, 200 Adam steps; recall of the true top blocks measured on the held-out
#    sequence (trained gate, untrained gate, Quest's bound). Sized for this shared two-core machine. The gate is
#    src/reasonkv/data/gates/smollm2-135m.pt; gates/gates.json holds the settings, every step's loss and the
#    recall; loss.png plots the loss.
# 2. (Measured before issue 48's defaults: quest and seer with blocks of 64, no dense layers, the current block
#    inside K, the earlier gate; rerun, these cells would measure the new defaults.) Fidelity (teacher-forced replay of the full cache's greedy trace: top-1 agreement and KL, and the K/V bytes
#    held and read at each decode step, measured) of quest and seer (selection: hold every token, read K per head
#    a step) at the frontier table's settings: SmolLM2-135M, GSM8K 40 + MATH-500 20, 512 new tokens, B = 32,
#    bf16, batch 32, at K = 128 (the eviction cells' K) and K = 192 (where selection reads about the bytes an
#    eviction cache of K = 128, B = 32 holds). The eviction rows (h2o, vase-attnv, triattention) are the uniform
#    cells of ../budgets/run.sh, replayed over the same traces with the same settings (run it first).
#    The full cache's traces are those of ../frontier/smollm2-135m.jsonl, copied in before the first run (the
#    replays feed them; without them eval generates them again, the same tokens, about 40 more minutes).
# Resumable: rerun to continue (eval appends and skips what is done).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/selection
if [ ! -f "$OUT/gates/gates.json" ]; then  # the gate (gates.pt is the shipped file; only gates.json is kept here)
  nice "$PY" -m reasonkv.cli calibrate --gates --model smollm2-135m --gate-traces 4 --held-out 1 \
    --max-new-tokens 384 --gate-batch 32 --gate-queries 64 --gate-steps 200 --no-progress --out "$OUT/gates"
  mv "$OUT/gates/gates.pt" src/reasonkv/data/gates/smollm2-135m.pt
fi
"$PY" - "$OUT/gates/gates.json" "$OUT/loss.png" <<'PLOT'
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
summary = json.load(open(sys.argv[1], encoding="utf-8"))
losses = summary["losses"]
window = 20
smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(losses, color="#56B4E9", linewidth=0.8, label="loss of the step's sequence")
ax.plot(smooth, color="#0072B2", linewidth=1.8, label=f"mean of the last {window} steps")
ax.set_xlabel("Adam step (one packed sequence each)")
ax.set_ylabel("KL to the model's block attention\n(sum over 30 layers)")
ax.set_yscale("log")
ax.set_title("seer gate, SmolLM2-135M: self-distillation")
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=120)
PLOT
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
RESULTS="$OUT/smollm2-frontier.jsonl"
if [ ! -f "$RESULTS" ]; then
  "$PY" docs/results/full_traces.py docs/results/frontier/smollm2-135m.jsonl "$RESULTS"
fi
"$PY" -m reasonkv.cli eval --model smollm2-135m --dataset gsm8k:40,math500:20 --policies full,quest,seer \
  --budgets 128,192 --buffer 32 --max-new-tokens 512 --batch-size 32 --dtype bf16 --fidelity-only --no-progress \
  --out "$RESULTS"
# vase-attnv's uniform cell on MATH-500, here too (the first runs of ../budgets/run.sh replayed it on GSM8K only)
"$PY" -m reasonkv.cli eval --model smollm2-135m --dataset math500:20 --policies full,vase-attnv --budgets 128 \
  --buffer 32 --max-new-tokens 512 --batch-size 32 --dtype bf16 --fidelity-only --no-progress --out "$RESULTS"
"$PY" -m reasonkv.cli report "$RESULTS" --out "$OUT/report" > /dev/null
EVICTION=(docs/results/budgets/smollm2-frontier.jsonl docs/results/budgets/smollm2-frontier-2.jsonl)
"$PY" "$OUT/summarise.py" "$OUT/summary.md" "$OUT/fidelity.png" "$RESULTS" "${EVICTION[@]}"
"$PY" -m reasonkv.cli.paired "$RESULTS" "${EVICTION[@]}" --against h2o --out "$OUT/paired-h2o.md"
# 3. HumanEval (the code grid's settings: the first 40 problems, 384 greedy tokens, fp32): quest and seer at K = 128
#    and 256 replay the full cache's traces of ../humaneval/grid/smollm2-135m.jsonl (copied in), beside the
#    eviction cells already there; paired by problem against vase-attnv. Fidelity only: this model passes none of
#    the problems with any cache.
for policy in quest seer; do
  FILE="$OUT/humaneval-$policy.jsonl"
  [ -f "$FILE" ] || "$PY" docs/results/full_traces.py docs/results/humaneval/grid/smollm2-135m.jsonl "$FILE"
  "$PY" -m reasonkv.cli eval --model smollm2-135m --dtype fp32 --dataset humaneval:40 --allow-code-execution \
    --policies "full,$policy" --budgets 128,256 --buffer 32 --max-new-tokens 384 --batch-size 20 --fidelity-only \
    --no-progress --out "$FILE"
done
"$PY" -m reasonkv.cli.paired docs/results/humaneval/grid/smollm2-135m.jsonl "$OUT/humaneval-quest.jsonl" \
  "$OUT/humaneval-seer.jsonl" --against vase-attnv --out "$OUT/humaneval-paired.md"
