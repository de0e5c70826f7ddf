#!/usr/bin/env bash
# Speed and memory of an 8B model's shape on one GPU (random weights: shapes decide speed, not weights).
#
# Part 1, lengths: Llama-3.1-8B / R1-Distill-Llama-8B shape, bf16, SDPA, batch 1, budget K = 4096,
#   buffer B = 128; full, epikv, vase-dkv, h2o, tova, triattention, expected-attention (streaming runs
#   as the reference; triattention's query centers come from the prefill: random weights). Each length
#   L in 8k/16k/32k/64k is reached by a prefill of L - n - 2 tokens (a 32-token prompt, then the
#   rest as if generated, in chunks of 8192; an evicting policy is evicted to K after each chunk
#   once due), 2 untimed decode steps, then n = 128 timed decode steps (one eviction cycle), so the
#   steady state at L is measured without decoding 64k tokens one by one. transformers' own cache
#   runs the same loop as the entry `transformers` (full against it: reasonkv's bookkeeping).
#   Goals: 65,536 tokens within the weights + 2 GB (peak allocated during the decode);
#   step time flat beyond K + B; eviction overhead a few % of a full step.
# Part 2, max batch: the largest batch each policy fits in MEMORY_LIMIT at 16k tokens (KV per row
#   computed, the rest measured) and the tokens/s measured at that batch (R-KV's comparison), over
#   BUFFER + 16 decode steps, so the timed window holds an eviction (B steps after the one that
#   started it); full, epikv, vase-dkv, and R-KV and ThinKV, whose evictions read every layer's keys
#   (in pieces of a bounded workspace). Goal: >= 3x the full cache's tokens/s at 16k.
#
# Part 3, quantized tier: TIER_POLICY at TIER_LENGTH, plain at K = BUDGET against TIER_QUANTIZED
#   int TIER_BITS tokens per head plus the full-precision budget at which the tiered cache holds the
#   same measured K/V bytes (bench --quantized: a short run of the tiered cache measures what its tier
#   holds, pending tokens included), side by side: step time and K/V bytes held.
#
# Part 4, compiled: COMPILE_POLICIES (with full and streaming, the references) at COMPILE_LENGTH, eager and
#   compiled side by side (bench --compile: each decode step one fixed-shape graph, torch.compile with CUDA
#   graphs, the eviction between steps), and plain transformers eager and compiled (a StaticCache and
#   torch.compile of its forward), at batch 1, 8 and 32, one bench run per batch size into the same folder
#   (batch 1 first: a run cut short by the time limit keeps the smaller batches). Compiling is timed apart
#   and never counted in tokens/s. Goal: compiled faster than eager, and at least as fast as transformers
#   compiled.
#
# Runs as is on a bare copy of the repository: it uses $PYTHON, else ./.venv/bin/python if there is
# one, else python3, with the package taken from src/ (PYTHONPATH), and needs only torch and
# transformers (no gguf, no math-verify, no plots). Sized for <= 9 minutes on one H200 by
# construction: each part has a time limit (PART1_SECONDS + PART2_SECONDS + PART3_SECONDS + PART4_SECONDS
# = 210 + 140 + 60 + 130 s = 9 minutes; parts 1-3 had 270 + 180 + 90 before part 4 came), and a part
# stopped by it keeps every entry it finished. Results: $OUT/lengths, $OUT/max-batch, $OUT/tier and
# $OUT/compiled (bench.json, bench.md, results.jsonl each: 12 result files), then a goal summary on stdout.
#
# Environment overrides: PYTHON, OUT (default bench-gpu), MODEL, DEVICE, POLICIES, BATCH_POLICIES,
# BUDGET, BUFFER, LENGTHS, DECODE_STEPS, PREFILL_CHUNK, MEMORY_LIMIT, BATCH_LENGTH, BATCH_STEPS,
# MAX_MEASURED_BATCH, PART1_SECONDS, PART2_SECONDS, TIER_POLICY, TIER_QUANTIZED, TIER_BITS, TIER_LENGTH,
# PART3_SECONDS, COMPILE_POLICIES, COMPILE_LENGTH, COMPILE_BATCHES, COMPILE_BACKEND (default inductor),
# PART4_SECONDS, BENCH_ARGS (extra arguments for every command).
# SMOKE=1 runs the same commands on the tiny shape on the CPU (a check of the recipe itself, about a
# minute; needs only the built-in policies; part 4 traces with aot_eager instead of compiling).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${SMOKE:-0}" == "1" ]]; then
  : "${MODEL:=shape:tiny}" "${DEVICE:=cpu}" "${POLICIES:=full,h2o,tova,triattention,expected-attention}"
  : "${BATCH_POLICIES:=full,random,rkv,thinkv}"
  : "${BUDGET:=48}" "${BUFFER:=16}" "${LENGTHS:=64,128,256}" "${DECODE_STEPS:=16}" "${PREFILL_CHUNK:=128}"
  : "${MEMORY_LIMIT:=1GiB}" "${BATCH_LENGTH:=128}" "${MAX_MEASURED_BATCH:=8}"
  : "${OUT:=bench-gpu-smoke}" "${BENCH_ARGS:=--threads 1}" "${TIER_POLICY:=random}" "${TIER_QUANTIZED:=32}"
  : "${TIER_LENGTH:=160}" "${PART3_SECONDS:=300}"
  : "${COMPILE_POLICIES:=streaming}" "${COMPILE_LENGTH:=96}" "${COMPILE_BATCHES:=1,2}" "${COMPILE_BACKEND:=aot_eager}"
  : "${PART4_SECONDS:=300}"
fi
MODEL="${MODEL:-shape:llama-3.1-8b}"
DEVICE="${DEVICE:-cuda}"
POLICIES="${POLICIES:-full,epikv,vase-dkv,h2o,tova,triattention,expected-attention}"
BATCH_POLICIES="${BATCH_POLICIES:-full,epikv,vase-dkv,rkv,thinkv}"
BUDGET="${BUDGET:-4096}"
BUFFER="${BUFFER:-128}"
LENGTHS="${LENGTHS:-8192,16384,32768,65536}"
DECODE_STEPS="${DECODE_STEPS:-128}"
PREFILL_CHUNK="${PREFILL_CHUNK:-8192}"
MEMORY_LIMIT="${MEMORY_LIMIT:-32GiB}"
BATCH_LENGTH="${BATCH_LENGTH:-16384}"
BATCH_STEPS="${BATCH_STEPS:-$((BUFFER + 16))}"
MAX_MEASURED_BATCH="${MAX_MEASURED_BATCH:-512}"
OUT="${OUT:-bench-gpu}"
PART1_SECONDS="${PART1_SECONDS:-210}"
PART2_SECONDS="${PART2_SECONDS:-140}"
TIER_POLICY="${TIER_POLICY:-vase-dkv}"
TIER_QUANTIZED="${TIER_QUANTIZED:-4096}"
TIER_BITS="${TIER_BITS:-4}"
TIER_LENGTH="${TIER_LENGTH:-16384}"
PART3_SECONDS="${PART3_SECONDS:-60}"
COMPILE_POLICIES="${COMPILE_POLICIES:-epikv}"
COMPILE_LENGTH="${COMPILE_LENGTH:-8192}"
COMPILE_BATCHES="${COMPILE_BATCHES:-1,8,32}"
COMPILE_BACKEND="${COMPILE_BACKEND:-inductor}"
PART4_SECONDS="${PART4_SECONDS:-130}"

# shellcheck disable=SC2206  # BENCH_ARGS: extra bench arguments, split on spaces on purpose
common=(--model "$MODEL" --dtype bf16 --device "$DEVICE" --attn sdpa --budget "$BUDGET" --buffer "$BUFFER"
  --no-progress --no-plots ${BENCH_ARGS:-})
status=0

echo "== part 1: step time and memory at $LENGTHS (batch 1)" >&2
timeout --signal=TERM "$PART1_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" --policies "$POLICIES" \
  --lengths "$LENGTHS" --prefill-to-length --decode-steps "$DECODE_STEPS" --prefill-chunk "$PREFILL_CHUNK" \
  --transformers-cache --batch-sizes 1 --out "$OUT/lengths" || status=$?

echo "== part 2: largest batch in $MEMORY_LIMIT at $BATCH_LENGTH tokens" >&2
# Tokens per prefill forward, summed over the batch: big batches are prefilled in slices of rows' tokens.
timeout --signal=TERM "$PART2_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" --policies "$BATCH_POLICIES" \
  --max-batch --memory-limit "$MEMORY_LIMIT" --length "$BATCH_LENGTH" --decode-steps "$BATCH_STEPS" \
  --max-measured-batch "$MAX_MEASURED_BATCH" --prefill-chunk $((PREFILL_CHUNK * 8)) --out "$OUT/max-batch" \
  || status=$?

echo "== part 3: $TIER_POLICY with $TIER_QUANTIZED int$TIER_BITS tokens against plain, same measured K/V bytes" >&2
timeout --signal=TERM "$PART3_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" --policies "$TIER_POLICY" \
  --quantized "$TIER_QUANTIZED" --bits "$TIER_BITS" --lengths "$TIER_LENGTH" --prefill-to-length \
  --decode-steps "$DECODE_STEPS" --prefill-chunk "$PREFILL_CHUNK" --batch-sizes 1 --no-plots --out "$OUT/tier" \
  || status=$?

echo "== part 4: eager against compiled decoding at $COMPILE_LENGTH tokens, batch $COMPILE_BATCHES" >&2
deadline=$((SECONDS + PART4_SECONDS))
for batch in ${COMPILE_BATCHES//,/ }; do
  left=$((deadline - SECONDS))
  ((left > 0)) || break
  timeout --signal=TERM "$left" "$PY" -m reasonkv.cli bench "${common[@]}" --policies "$COMPILE_POLICIES" \
    --lengths "$COMPILE_LENGTH" --prefill-to-length --decode-steps "$DECODE_STEPS" --prefill-chunk "$PREFILL_CHUNK" \
    --batch-sizes "$batch" --compile "$COMPILE_BACKEND" --out "$OUT/compiled" || status=$?
done

"$PY" - "$OUT" "$BATCH_LENGTH" <<'EOF'
import json
import sys
from pathlib import Path

out, batch_length = Path(sys.argv[1]), int(sys.argv[2])
print("== goals (reported, not asserted)")
lengths = out / "lengths" / "bench.json"
if lengths.is_file():
    doc = json.loads(lengths.read_text())
    weights = doc.get("weight_bytes") or 0
    print(f"weights: {weights / 2**30:.2f} GiB; peak allocated during decode minus weights (goal: <= 2 GB):")
    for record in doc["records"]:
        windows = sorted(record["windows"], key=lambda w: w["length"])
        cells = []
        for w in windows:
            peak = w.get("peak_memory_bytes")
            if peak is not None:
                cells.append(f"{w['length']}: {(peak - weights) / 1e9:.2f} GB")
        print(f"  {record['policy']:>10}  " + ", ".join(cells))
    for batch, summary in doc["summary"]["sweep"].items():
        for name, s in summary["policies"].items():
            flat = s.get("flatness") or {}
            ratio = flat.get("ratio")
            over = s.get("overhead_pct_steady")
            print(
                f"  {name:>10}  flatness {'-' if ratio is None else f'{ratio:.3f}'}"
                f"  overhead {'-' if over is None else f'{over:.2f}%'} of a full step"
            )
        versus = summary["targets"].get("full_vs_transformers")
        if versus is not None:
            print(f"  full through an EvictingCache: {versus:.3f}x the tokens/s of transformers' own cache (goal: >= 0.98)")
batches = out / "max-batch" / "bench.json"
if batches.is_file():
    doc = json.loads(batches.read_text())
    ratios = (doc["summary"].get("max_batch") or {}).get("tokens_per_s_vs_full", {})
    print(f"tokens/s relative to full at {batch_length} tokens, each at its largest batch (goal: >= 3x):")
    for record in doc["records"]:
        ratio = ratios.get(record["policy"])
        notes = "; ".join(record.get("notes", []))
        print(
            f"  {record['policy']:>10}  batch {record['measured_batch']} (fits {record['max_batch']})"
            f"  {'-' if ratio is None else f'{ratio:.2f}x'}  {notes}"
        )
tier = out / "tier" / "bench.json"
if tier.is_file():
    doc = json.loads(tier.read_text())
    print("quantized tier against plain at the same measured K/V bytes (step time, K/V held, relative to plain):")
    for variants in (doc["summary"].get("tiers") or {}).values():
        for label, s in variants.items():
            for length, ratio in s["step_vs_plain"].items():
                kv = s["kv_bytes_vs_plain"].get(length)
                print(
                    f"  {label}: K' = {s['budget']} (nominal {s.get('nominal_budget', s['budget'])}) + Q = "
                    f"{s['quantized']} vs K = {s['plain_budget']} at {length}: "
                    f"step {ratio:.3f}x, K/V {'-' if kv is None else f'{kv:.3f}x'}"
                )
compiled = out / "compiled" / "bench.json"
if compiled.is_file():
    doc = json.loads(compiled.read_text())
    print("compiled against eager (tokens/s), and against transformers compiled; warm-up apart:")
    for batch, variants in (doc["summary"].get("compiled") or {}).items():
        for s in variants.values():
            for length, ratio in s["compiled_vs_eager"].items():
                versus = s["vs_transformers_compiled"].get(length)
                warmup = s["warmup_seconds"]
                print(
                    f"  batch {batch} {s['policy']:>12} at {length}: {s['compiled_tokens_per_s'][length]:.1f} tok/s "
                    f"compiled, {ratio:.2f}x eager, {'-' if versus is None else f'{versus:.2f}x'} transformers "
                    f"compiled; warm-up {'-' if warmup is None else f'{warmup:.0f} s'}"
                    + (f" (ran eager: {s['eager_reason']})" if s["eager_reason"] else "")
                )
EOF
exit "$status"
