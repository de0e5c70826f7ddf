#!/usr/bin/env bash
# lm-eval's own hf model on the run.sh tasks and settings, loading the bundled model's converted checkpoint
# itself (fp32), then reasonkv's full cache (runs/full) against it.
set -euo pipefail
cd "$(dirname "$0")"
checkpoint=$(python -c 'import reasonkv
from reasonkv.models.bundled import cache_dir
reasonkv.load_model("smollm2-135m")  # converts it once into the cache
print(cache_dir() / "models" / "smollm2-135m")')
reasonkv lm-eval --model hf --tasks reasonkv_gsm8k,reasonkv_gsm8k_reference --limit 10 --apply_chat_template \
  --gen_kwargs max_gen_toks=128 --batch_size 10 --model_args "pretrained=$checkpoint,dtype=float32" \
  --log_samples --output_path runs/hf
python summarize.py --hf runs/full runs/hf
