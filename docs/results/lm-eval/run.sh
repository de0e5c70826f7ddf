#!/usr/bin/env bash
# The lm-evaluation-harness run of README "With lm-evaluation-harness": reasonkv's local GSM8K tasks (bundled
# data, no network) on the bundled SmolLM2-135M-Instruct, CPU, fp32: the full cache against two evicting
# policies at K = 64, B = 16 (a prompt longer than K + B is evicted after prefill, every output as it grows),
# then lm-eval's own hf model on the same requests, then the tables in README.md from lm-eval's outputs.
set -euo pipefail
cd "$(dirname "$0")"
for policy in full streaming h2o; do
  reasonkv lm-eval --tasks reasonkv_gsm8k,reasonkv_gsm8k_reference --limit 10 --apply_chat_template \
    --gen_kwargs max_gen_toks=128 --batch_size 10 \
    --model_args "pretrained=smollm2-135m,policy=$policy,budget=64,buffer=16" \
    --log_samples --output_path "runs/$policy"
done
# lm-eval's hf model loads the checkpoint reasonkv converted for the bundled model (the runs above made it).
checkpoint=$(python -c "from reasonkv.models.bundled import cache_dir; print(cache_dir() / 'models' / 'smollm2-135m')")
reasonkv lm-eval --model hf --tasks reasonkv_gsm8k,reasonkv_gsm8k_reference --limit 10 --apply_chat_template \
  --gen_kwargs max_gen_toks=128 --batch_size 10 --model_args "pretrained=$checkpoint,dtype=float32" \
  --log_samples --output_path runs/hf
python summarize.py runs/full runs/streaming runs/h2o --hf runs/hf
