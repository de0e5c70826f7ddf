#!/usr/bin/env bash
# Selection against eviction on long traces (issue 48's comparison), SmolLM2-135M on CPU: under way (long-traces.jsonl
# holds the traces and the cells done so far; rerun to continue).
#
# The full cache's traces are sampled at temperature 0.6 (as the papers decode, so that they do not loop) and
# hold more than 2,048 tokens each: the model's own sampled answers to later GSM8K problems packed as a context
# before each problem until context and prompt hold 2,048 tokens, then its sampled answer (up to 512 tokens). One set of traces (20 problems) is made once
# and teacher-forced through every cell: quest, seer (the authors' settings, the defaults), h2o, vase-attnv,
# triattention and streaming at K = 128, 256 and 512, B = 32, bf16, 10 traces a batch.
# Each cell records, per problem, top-1 agreement with the full cache's argmax, KL(full || cache) and the K/V
# bytes held and read per decode step (measured on the cache), with its wall time. Sized to finish in about four
# hours on this machine's two cores. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${PYTHON:-.venv/bin/python}"
OUT=docs/results/selection
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
PYTHONPATH=src "$PY" "$OUT/long_traces.py" "$OUT/long-traces.jsonl" --model smollm2-135m --dtype bf16 \
  --problems 20 --min-tokens 2048 --max-new-tokens 512 --budgets 128,256,512 \
  --policies quest,seer,h2o,vase-attnv,triattention,streaming --buffer 32 --batch 10
# The tables, trace lengths and wall times (long-traces.md, printed too) and the plot (long-traces.png):
PYTHONPATH=src "$PY" "$OUT/summarise_long.py" "$OUT/long-traces.jsonl"
