#!/usr/bin/env bash
# Compiled against eager decoding, side by side in one run: SmolLM2-135M (bundled weights) in fp32 on one
# thread, K = 128, B = 32, 160 timed decode steps (five eviction cycles) ending at 512 tokens after a prefill
# to the length, batch 1 and 8. Every policy eager and, right after it, as POLICY~compiled (inductor), and
# plain transformers eager (its dynamic cache) and compiled (a StaticCache and torch.compile of its forward).
# Then the same on the random-weight tiny shape, and SmolLM2 in bf16. The CPU was shared with other jobs:
# compare entries within a run. Resumable: finished entries are skipped (the graphs compile again).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
COMMON=(--dtype fp32 --threads 1 --policies full,streaming,epikv,snapkv,h2o --budget 128 --buffer 32
  --batch-sizes 1,8 --lengths 512 --prefill-to-length --decode-steps 160 --compile --no-plots --no-progress)
"$PY" -m reasonkv.cli bench --model smollm2-135m "${COMMON[@]}" --out docs/benchmarks/cpu-compiled/smollm2-fp32
"$PY" -m reasonkv.cli bench --model shape:tiny "${COMMON[@]}" --out docs/benchmarks/cpu-compiled/tiny-fp32
"$PY" -m reasonkv.cli bench --model smollm2-135m "${COMMON[@]/fp32/bf16}" --out docs/benchmarks/cpu-compiled/smollm2-bf16
