"""Throughput of vLLM's CPU engine with and without reasonkv's eviction, side by side in one run.

    .venv-vllm/bin/python scripts/vllm_throughput.py --policies full,streaming,snapkv --budgets 128,512 \
        --batches 1,8 --prompt-lengths 1024,4096 --new-tokens 256 --kv-blocks 256

For every policy and budget one engine (the full cache once, with no budget) with the same fixed KV pool
(``--kv-blocks`` blocks of ``--block-size`` tokens), and in it every batch size and prompt length: ``batch``
requests of ``prompt length`` token ids (seeded, within the vocabulary) submitted together, each decoding
``--new-tokens`` greedy tokens with ``ignore_eos``. Prints one markdown row per cell: requests per minute, generated
tokens per second, and the preemptions vLLM's own metrics counted. Needs the environment scripts/setup_vllm.sh
builds; run on a quiet machine (the figures are wall-clock).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The memory vLLM reserves for KV (GiB): the fixed pool of --kv-blocks lies within it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2, converted)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--policies", default="full,streaming,snapkv", help="comma-separated; 'full' is plain vLLM")
    p.add_argument("--budgets", type=_ints, default=[128, 512], help="K values (comma-separated)")
    p.add_argument("--buffer", type=int, default=64, help="B")
    p.add_argument("--batches", type=_ints, default=[1, 8])
    p.add_argument("--prompt-lengths", type=_ints, default=[1024, 4096])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv-blocks", type=int, default=256, help="the fixed KV pool, in blocks")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p


def _engine(args, model: str, reasonkv: dict | None):
    from vllm import LLM

    return LLM(
        model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_gpu_blocks_override=args.kv_blocks,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=max(args.prompt_lengths) + args.new_tokens,
        max_num_batched_tokens=max(args.prompt_lengths) + args.new_tokens,
        max_num_seqs=max(args.batches),
        disable_log_stats=False,
        seed=args.seed,
        additional_config={} if reasonkv is None else {"reasonkv": reasonkv},
    )


def _preemptions(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main() -> None:
    args = parser().parse_args()
    from vllm import SamplingParams

    from reasonkv.models.bundled import BUNDLED, DEFAULT_MODEL, _ensure_converted

    model = args.model or str(_ensure_converted(BUNDLED[DEFAULT_MODEL]))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engines = []
    for policy in args.policies.split(","):
        if policy == "full":
            engines.append(("full", "-", None))
        else:
            for budget in args.budgets:
                engines.append((policy, budget, {"policy": policy, "budget": budget, "buffer": args.buffer}))
    print(
        f"KV pool: {args.kv_blocks} blocks of {args.block_size} tokens; B = {args.buffer}; {args.new_tokens} new tokens"
    )
    print("| policy | K | batch | prompt | requests/min | tokens/s | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for policy, budget, settings in engines:
        llm = _engine(args, model, settings)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        for batch in args.batches:
            for length in args.prompt_lengths:
                rng = random.Random(args.seed + batch * 100003 + length)
                prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(batch)]
                before = _preemptions(llm)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                preempted = _preemptions(llm) - before
                print(
                    f"| {policy} | {budget} | {batch} | {length} | {60 * batch / seconds:.2f} | {tokens / seconds:.2f} "
                    f"| {preempted} |",
                    flush=True,
                )
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
