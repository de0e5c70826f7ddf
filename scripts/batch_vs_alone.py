"""Does a prompt decode to the same tokens in a batch as alone? Measured per dtype and policy.

    python scripts/batch_vs_alone.py --model smollm2-135m --dtypes fp32,bf16 --policies full,streaming,h2o \
        --prompts 8 --max-new-tokens 128 --budget 64 --buffer 16

Decodes the first ``--prompts`` GSM8K questions (chat-formatted, greedy) once as one left-padded
batch and once each alone, and prints, per dtype and policy, how many rows came out identical and,
for the others, the token at which they first differ.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import reasonkv
from reasonkv.cli.demo import first_difference
from reasonkv.cli.generate import chat_format
from reasonkv.eval.datasets import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--policies", default="full,streaming")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("| dtype | policy | rows identical | first difference (token) of the others |")
    print("|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        model, tokenizer = reasonkv.load_model(args.model, dtype=dtype)
        prompts = [chat_format(tokenizer, p.problem) for p in load_dataset("gsm8k", limit=args.prompts)]
        for policy in args.policies.split(","):
            kwargs = dict(
                policy=policy,
                budget=None if policy == "full" else args.budget,
                buffer=args.buffer,
                max_new_tokens=args.max_new_tokens,
            )
            together = reasonkv.generate(model, tokenizer, prompts, **kwargs)
            differences = []
            for prompt, row in zip(prompts, together, strict=True):
                [alone] = reasonkv.generate(model, tokenizer, prompt, **kwargs)
                differences.append(first_difference(row.token_ids, alone.token_ids))
            others = sorted(d for d in differences if d is not None)
            where = f"{others} (median {statistics.median(others)})" if others else "-"
            print(f"| {dtype} | {policy} | {differences.count(None)} of {len(prompts)} | {where} |", flush=True)


if __name__ == "__main__":
    main()
