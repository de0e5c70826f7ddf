#!/usr/bin/env bash
# Speed and memory of an 8B model's shape on one GPU (random weights: shapes decide speed, not weights).
#
# Llama-3.1-8B / R1-Distill-Llama-8B shape, bf16, SDPA, budget K = 4096, buffer B = 32. Every length L is
# reached by a prefill (a 32-token prompt, then the rest as if generated, in chunks of 8192 tokens; an
# evicting policy is evicted to K after each chunk once due), 2 untimed decode steps, then n = 32 timed
# steps ending at L, a window that holds one eviction (n = B). One cache per entry is extended from each
# length to the next. Entries of one run are measured in ROUNDS = 3 interleaved rounds (A B C A B C A B C),
# each figure the median round, the rounds' spread and the GPU's SM clock beside it, and ratios only
# between entries of the same rounds (timings drifted about 3x within one process in the first run).
# The parts, compiled first:
#
# Part 1, compiled: COMPILE_POLICIES (with full and streaming, the references) at COMPILE_LENGTH, batch
#   COMPILE_BATCHES, eager and compiled side by side (bench --compile: each decode step one fixed-shape
#   graph, torch.compile with CUDA graphs, the eviction between steps), and plain transformers eager and
#   compiled (a StaticCache and torch.compile of its forward; checked to run no reasonkv code). Compiling
#   is timed apart and never counted in tokens/s. Goals: compiled faster than eager, at least 0.9x
#   transformers compiled; tokens/s as a fraction of the roofline (weights + K/V held, read once a step at
#   HBM_BYTES_PER_S).
# Part 2, lengths: full, epikv (POLICIES) and the references at 8k and 64k (LENGTHS), batch 1, and
#   transformers' own cache through the same loop. Goals: peak allocated during the decode window minus
#   the weights <= 2 GB at 64k; 64k tokens/s within 10% of 8k for an evicting policy; full through an
#   EvictingCache within 2% of transformers' own cache.
# Part 3, max batch: the largest batch full and epikv (BATCH_POLICIES) fit in MEMORY_LIMIT at 16k tokens
#   (KV per row computed, the rest measured) and the tokens/s measured at that batch, over B + 16 decode
#   steps (one eviction in the window). Measured once each, not in rounds. Goal: >= 3x full's tokens/s.
# Part 4, quantized tier: TIER_POLICY plain at K against TIER_QUANTIZED int TIER_BITS tokens per head plus
#   the full-precision budget at which the tiered cache holds the same measured K/V bytes, at TIER_LENGTH.
#
# Time budget (9 minutes = 540 s on one H200), from the first run's log (2026-12-04, recipe-log.txt and
# the four bench.json there): eager decode steps took 21-90 ms (full 60-90 ms from 8k to 64k,
# transformers 55-72 ms, evicting policies 21-24 ms and up to 60 ms in the slow periods: budgeted at
# 65 ms at 8k and 16k, 90 ms at 64k); a batch-1 prefill of 64k tokens 3.3-6.4 s, of 8k 0.3-0.5 s, of 16k
# 0.8-1.2 s; loading the model plus the warm-up at most about 17 s a part (part 3 there: 60 s limit, 43 s
# of entries), budgeted at 23 s with the warm-up until stable (at most 96 steps, 6 s). Compiling was never
# reached there (the compiled step crashed first): budgeted at 30 s a graph, an assumption. An entry
# round costs its prefill plus 34 decode steps per length.
#   part 1: 8 entries x 3 rounds x (0.5 s + 34 x 65 ms = 2.7 s) = 65 s, 4 graphs (full at 8k,
#           StaticCache at 8k, streaming and epikv: one each) x 30 s = 120 s, + 23 s   = 208 s  (limit 215)
#   part 2: per round full 6.4 + 2 x 34 x 90 ms = 12.5 s, transformers 6.4 + 2 x 34 x 72 ms = 11.3 s,
#           streaming and epikv 4.6 + 2 x 34 x 60 ms = 8.7 s each: 41 s; x 3 rounds + 23 s = 147 s  (limit 150)
#   part 3: full 24 s and epikv 38 s there with 144 steps; 48 steps save 96 x 81 ms each: 46 s + 23 s = 69 s
#           (limit 80)
#   part 4: per round full 1.0 + 34 x 69 ms = 3.4 s, streaming 3.0 s, vase-dkv 1.2 + 34 x 60 ms = 3.2 s, the
#           tiered variant 3.2 s plus its calibration (a prefill of about 7.2k tokens, 33 steps) 2.5 s:
#           15.3 s; x 3 rounds + 23 s                                                   = 69 s   (limit 75)
#   total 493 s of 520 s of limits; each part's limit stops it (SIGTERM), keeping every finished entry and
#   the rounds measured of the others. A persistent inductor cache under $OUT (TORCHINDUCTOR_CACHE_DIR,
#   TORCHINDUCTOR_FX_GRAPH_CACHE=1) makes a rerun's compiling a cache hit.
#
# SMOKE=gpu: part 1 only, at 8k, batch 1, full / streaming / epikv (and the transformers pair) eager and
#   compiled, in 2 rounds: 8 x 2 x 2.7 s + 120 s + 23 s = 186 s, about 3 minutes (limit 200 s).
# SMOKE=1: the same commands on the tiny shape on the CPU, in 2 rounds (a check of the recipe itself, a few
#   minutes on 2 shared cores; needs only the built-in policies; part 1 traces with aot_eager, no inductor).
#
# Runs as is on a bare copy of the repository: it uses $PYTHON, else ./.venv/bin/python if there is one,
# else python3, with the package taken from src/ (PYTHONPATH), and needs only torch and transformers (no
# gguf, no math-verify, no plots). Results: $OUT/compiled, $OUT/lengths, $OUT/max-batch and $OUT/tier
# (bench.json, bench.md, results.jsonl each), then a goal summary on stdout.
#
# Environment overrides: PYTHON, OUT (default bench-gpu), MODEL, DEVICE, PARTS (default
# compiled,lengths,max-batch,tier), ROUNDS, BUDGET, BUFFER, DECODE_STEPS, PREFILL_CHUNK, COMPILE_POLICIES,
# COMPILE_LENGTH, COMPILE_BATCHES, COMPILE_BACKEND (default inductor), COMPILE_SECONDS, POLICIES, LENGTHS,
# LENGTHS_SECONDS, BATCH_POLICIES, MEMORY_LIMIT, BATCH_LENGTH, BATCH_STEPS, MAX_MEASURED_BATCH,
# BATCH_SECONDS, TIER_POLICY, TIER_QUANTIZED, TIER_BITS, TIER_LENGTH, TIER_SECONDS, HBM_BYTES_PER_S
# (default 4.8e12, the H200's), BENCH_ARGS (extra arguments for every command).
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
case "${SMOKE:-0}" in
  0) ;;
  1)
    : "${MODEL:=shape:tiny}" "${DEVICE:=cpu}" "${OUT:=bench-gpu-smoke}" "${BENCH_ARGS:=--threads 1}" "${ROUNDS:=2}"
    : "${BUDGET:=48}" "${BUFFER:=16}" "${DECODE_STEPS:=16}" "${PREFILL_CHUNK:=128}"
    : "${COMPILE_POLICIES:=epikv}" "${COMPILE_LENGTH:=96}" "${COMPILE_BATCHES:=1,2}" "${COMPILE_BACKEND:=aot_eager}"
    : "${POLICIES:=full,h2o,tova}" "${LENGTHS:=96,256}"
    : "${BATCH_POLICIES:=full,random,rkv}" "${MEMORY_LIMIT:=1GiB}" "${BATCH_LENGTH:=128}" "${MAX_MEASURED_BATCH:=8}"
    : "${TIER_POLICY:=random}" "${TIER_QUANTIZED:=32}" "${TIER_LENGTH:=160}"
    : "${COMPILE_SECONDS:=300}" "${LENGTHS_SECONDS:=300}" "${BATCH_SECONDS:=300}" "${TIER_SECONDS:=300}"
    ;;
  gpu)
    : "${PARTS:=compiled}" "${ROUNDS:=2}" "${OUT:=bench-gpu-smoke}" "${COMPILE_SECONDS:=200}"
    ;;
  *)
    echo "SMOKE must be 0, 1 (the tiny shape on the CPU) or gpu (part 1 alone, about 3 minutes), got '$SMOKE'" >&2
    exit 2
    ;;
esac
MODEL="${MODEL:-shape:llama-3.1-8b}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-bench-gpu}"
PARTS="${PARTS:-compiled,lengths,max-batch,tier}"
ROUNDS="${ROUNDS:-3}"
BUDGET="${BUDGET:-4096}"
BUFFER="${BUFFER:-32}"
DECODE_STEPS="${DECODE_STEPS:-32}"
PREFILL_CHUNK="${PREFILL_CHUNK:-8192}"
COMPILE_POLICIES="${COMPILE_POLICIES:-epikv}"
COMPILE_LENGTH="${COMPILE_LENGTH:-8192}"
COMPILE_BATCHES="${COMPILE_BATCHES:-1}"
COMPILE_BACKEND="${COMPILE_BACKEND:-inductor}"
COMPILE_SECONDS="${COMPILE_SECONDS:-215}"
POLICIES="${POLICIES:-full,epikv}"
LENGTHS="${LENGTHS:-8192,65536}"
LENGTHS_SECONDS="${LENGTHS_SECONDS:-150}"
BATCH_POLICIES="${BATCH_POLICIES:-full,epikv}"
MEMORY_LIMIT="${MEMORY_LIMIT:-32GiB}"
BATCH_LENGTH="${BATCH_LENGTH:-16384}"
BATCH_STEPS="${BATCH_STEPS:-$((BUFFER + 16))}"
MAX_MEASURED_BATCH="${MAX_MEASURED_BATCH:-512}"
BATCH_SECONDS="${BATCH_SECONDS:-80}"
TIER_POLICY="${TIER_POLICY:-vase-dkv}"
TIER_QUANTIZED="${TIER_QUANTIZED:-4096}"
TIER_BITS="${TIER_BITS:-4}"
TIER_LENGTH="${TIER_LENGTH:-16384}"
TIER_SECONDS="${TIER_SECONDS:-75}"
HBM_BYTES_PER_S="${HBM_BYTES_PER_S:-4.8e12}"

for part in ${PARTS//,/ }; do
  case "$part" in
    compiled | lengths | max-batch | tier) ;;
    *) echo "PARTS: unknown part '$part' (compiled, lengths, max-batch, tier)" >&2 && exit 2 ;;
  esac
done
wants() { [[ ",$PARTS," == *",$1,"* ]]; }

# Compiled graphs persist under the output folder, so that a rerun (or a later part) loads them.
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(cd "$OUT" && pwd)/inductor-cache}"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1

# shellcheck disable=SC2206  # BENCH_ARGS: extra bench arguments, split on spaces on purpose
common=(--model "$MODEL" --dtype bf16 --device "$DEVICE" --attn sdpa --budget "$BUDGET" --buffer "$BUFFER"
  --rounds "$ROUNDS" --no-progress --no-plots ${BENCH_ARGS:-})
prefilled=(--prefill-to-length --decode-steps "$DECODE_STEPS" --prefill-chunk "$PREFILL_CHUNK" --no-reference-lengths)
status=0

if wants compiled; then
  echo "== part 1: eager against compiled decoding at $COMPILE_LENGTH tokens, batch $COMPILE_BATCHES" >&2
  deadline=$((SECONDS + COMPILE_SECONDS))
  for batch in ${COMPILE_BATCHES//,/ }; do
    left=$((deadline - SECONDS))
    ((left > 0)) || break
    timeout --signal=TERM "$left" "$PY" -m reasonkv.cli bench "${common[@]}" "${prefilled[@]}" \
      --policies "$COMPILE_POLICIES" --lengths "$COMPILE_LENGTH" --batch-sizes "$batch" --compile "$COMPILE_BACKEND" \
      --out "$OUT/compiled" || status=$?
  done
fi

if wants lengths; then
  echo "== part 2: step time and memory at $LENGTHS (batch 1)" >&2
  timeout --signal=TERM "$LENGTHS_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" "${prefilled[@]}" \
    --policies "$POLICIES" --lengths "$LENGTHS" --transformers-cache --batch-sizes 1 --out "$OUT/lengths" \
    || status=$?
fi

if wants max-batch; then
  echo "== part 3: largest batch in $MEMORY_LIMIT at $BATCH_LENGTH tokens" >&2
  # Tokens per prefill forward, summed over the batch: big batches are prefilled in slices of rows' tokens.
  timeout --signal=TERM "$BATCH_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" --policies "$BATCH_POLICIES" \
    --max-batch --memory-limit "$MEMORY_LIMIT" --length "$BATCH_LENGTH" --decode-steps "$BATCH_STEPS" \
    --max-measured-batch "$MAX_MEASURED_BATCH" --prefill-chunk $((PREFILL_CHUNK * 8)) --out "$OUT/max-batch" \
    || status=$?
fi

if wants tier; then
  echo "== part 4: $TIER_POLICY with $TIER_QUANTIZED int$TIER_BITS tokens against plain, same measured K/V bytes" >&2
  timeout --signal=TERM "$TIER_SECONDS" "$PY" -m reasonkv.cli bench "${common[@]}" "${prefilled[@]}" \
    --policies "$TIER_POLICY" --quantized "$TIER_QUANTIZED" --bits "$TIER_BITS" --lengths "$TIER_LENGTH" \
    --batch-sizes 1 --out "$OUT/tier" || status=$?
fi

"$PY" - "$OUT" "$BATCH_LENGTH" "$HBM_BYTES_PER_S" <<'EOF'
import json
import sys
from pathlib import Path

out, batch_length, bandwidth = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
print("== goals (reported, not asserted)")


def load(part):
    path = out / part / "bench.json"
    return json.loads(path.read_text()) if path.is_file() else None


def spread(w):
    """tok/s of the median round, the rounds' range and the SM clock."""
    rounds = w.get("rounds") or {}
    tps = rounds.get("tokens_per_s") or [w["tokens_per_s"]]
    clock = w.get("gpu_clock_mhz")
    text = f"{w['tokens_per_s']:.1f} tok/s"
    if len(tps) > 1:
        text += f" (rounds {min(tps):.1f}-{max(tps):.1f})"
    return text + ("" if clock is None else f" at {clock} MHz")


doc = load("compiled")
if doc is not None:
    weights, gpu = doc.get("weight_bytes") or 0, doc.get("device", "cpu").startswith("cuda")
    print("compiled against eager and transformers compiled"
          + (f"; roofline: weights + K/V held read at {bandwidth / 1e12:.1f} TB/s:" if gpu else ":"))
    for record in doc["records"]:
        if record.get("status") == "ok" and record["policy"].endswith("~compiled"):
            for w in record["windows"]:
                roofline = record["batch"] * bandwidth / (weights + (w.get("kv_bytes_used") or w["kv_bytes"]))
                share = f", {w['tokens_per_s'] / roofline:.0%} of the roofline ({roofline:.0f} tok/s)" if gpu else ""
                print(f"  batch {record['batch']} {record['policy']:>22} at {w['length']}: {spread(w)}{share}")
    for batch, variants in (doc["summary"].get("compiled") or {}).items():
        for s in variants.values():
            for length, ratio in s["compiled_vs_eager"].items():
                versus = s["vs_transformers_compiled"].get(length)
                warmup = s["warmup_seconds"]
                print(
                    f"  batch {batch} {s['policy']:>12} at {length}: {ratio:.2f}x eager, "
                    f"{'-' if versus is None else f'{versus:.2f}x'} transformers compiled (goal: >= 0.9x); "
                    f"compiling {'-' if warmup is None else f'{warmup:.0f} s'}"
                    + (f" (ran eager: {s['eager_reason']})" if s["eager_reason"] else "")
                )
    for error in doc.get("errors", []):
        print(f"  failed: {error['policy']} batch {error['batch']}: {error['error'][:200]}")

doc = load("lengths")
if doc is not None:
    weights = doc.get("weight_bytes") or 0
    what = "allocated" if doc.get("device", "cpu").startswith("cuda") else "resident set (a CPU's)"
    print(f"weights: {weights / 2**30:.2f} GiB; peak {what} during the decode window minus weights (goal: <= 2 GB at 64k):")
    for record in doc["records"]:
        if record.get("status") != "ok":
            continue
        windows = sorted(record["windows"], key=lambda w: w["length"])
        cells = [f"{w['length']}: {(w['peak_memory_bytes'] - weights) / 1e9:.2f} GB" for w in windows if w.get("peak_memory_bytes")]
        print(f"  {record['policy']:>12}  " + ", ".join(cells))
        print(f"  {'':>12}  " + "; ".join(f"{w['length']}: {spread(w)}" for w in windows))
        if record.get("evicts") and len(windows) > 1:
            flat = windows[-1]["tokens_per_s"] / windows[0]["tokens_per_s"]
            print(f"  {'':>12}  tokens/s at {windows[-1]['length']} over {windows[0]['length']}: {flat:.3f} (goal: >= 0.9)")
    for summary in doc["summary"]["sweep"].values():
        versus = summary["targets"].get("full_vs_transformers")
        if versus is not None:
            print(f"  full through an EvictingCache: {versus:.3f}x the tokens/s of transformers' own cache (goal: >= 0.98)")

doc = load("max-batch")
if doc is not None:
    ratios = (doc["summary"].get("max_batch") or {}).get("tokens_per_s_vs_full", {})
    print(f"tokens/s relative to full at {batch_length} tokens, each at its largest batch, measured one after another (goal: >= 3x):")
    for record in doc["records"]:
        ratio = ratios.get(record["policy"])
        notes = "; ".join(record.get("notes", []))
        print(
            f"  {record['policy']:>10}  batch {record.get('measured_batch')} (fits {record.get('max_batch')})"
            f"  {'-' if ratio is None else f'{ratio:.2f}x'}  {notes}"
        )

doc = load("tier")
if doc is not None:
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
EOF
exit "$status"
