#!/usr/bin/env bash
# Per-step overhead and the cost of one eviction of triattention, expected-attention and keydiff beside full,
# streaming, epikv and h2o, on SmolLM2-135M bf16 on one thread, K = 512, B = 128: the steady state at 1024 and
# 2048 tokens (a prefill to each length evicts to K, then 128 timed decode steps, one whole eviction cycle) and
# one eviction at 4096 cached tokens. The settings of ../cpu-overhead-before-after at its two shorter lengths
# (the CPU was shared with other jobs: compare policies within this run). triattention reads the query centers
# shipped for the model. Resumable: finished entries are skipped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli bench --model smollm2-135m --dtype bf16 --threads 1 --budget 512 --buffer 128 \
  --policies full,streaming,epikv,h2o,triattention,expected-attention,keydiff -o triattention.stats=bundled \
  --lengths 1024,2048 --prefill-to-length --decode-steps 128 --eviction-cost --cached 4096 --repeats 3 \
  --no-plots --no-progress --out docs/benchmarks/cpu-frontier/bench
