#!/usr/bin/env bash
# Per-step cost and bytes held per layer under each allocation, ragged storage against heads padded to the
# widest (bench.md, bench.json). CPU, one thread, the bundled SmolLM2-135M.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python scripts/budgets_bench.py --model smollm2-135m --policies snapkv,h2o --budget 64 --buffer 16 \
    --steps 150 --repeats 3 --threads 1 --out docs/results/budgets
