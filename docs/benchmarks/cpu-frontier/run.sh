#!/usr/bin/env bash
# Per-step overhead and the cost of one eviction of triattention, expected-attention and keydiff beside full,
# streaming and epikv, on SmolLM2-135M bf16 on one thread, K = 512, B = 128: the steady state at 1024 tokens (a
# prefill to the length evicts to K, then 128 timed decode steps, one whole eviction cycle) and one eviction at
# 4096 cached tokens; one repeat. The settings of ../cpu-overhead-before-after at its shortest length. The CPU
# was shared with other jobs: compare policies within this run, and read a policy's share of its own step
# (the score column against the step), not absolute times. triattention reads the query centers shipped for
# the model. Resumable: finished entries are skipped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" -m reasonkv.cli bench --model smollm2-135m --dtype bf16 --threads 1 --budget 512 --buffer 128 \
  --policies full,streaming,epikv,triattention,expected-attention,keydiff -o triattention.stats=bundled \
  --lengths 1024 --prefill-to-length --decode-steps 128 --eviction-cost --cached 4096 --repeats 1 \
  --no-plots --no-progress --out docs/benchmarks/cpu-frontier/bench
