"""Does a compiled decode give the tokens an eager one gives? Measured per dtype, policy and batch size.

    python scripts/compiled_vs_eager.py --model smollm2-135m --dtypes fp32,bf16 \
        --policies streaming,h2o,epikv,snapkv --prompts 8 --max-new-tokens 128 --budget 64 --buffer 16

Decodes the first ``--prompts`` GSM8K questions (chat-formatted, greedy) eagerly and with
``compile=BACKEND`` (default inductor), as one left-padded batch and each alone, and prints, per dtype,
policy and batch size, how many rows came out identical and, for the others, the token at which they
first differ; and the compilations and their seconds (left out of the decode time).
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
    parser.add_argument("--policies", default="streaming,h2o")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("| dtype | policy | batch | rows identical | first difference (token) of the others | compilations (s) |")
    print("|---|---|---|---|---|---|")
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
            for batches in ([prompts], [[p] for p in prompts]):
                differences, compilations, seconds = [], 0, 0.0
                for batch in batches:
                    eager = reasonkv.generate(model, tokenizer, batch, **kwargs)
                    compiled = reasonkv.generate(model, tokenizer, batch, compile=args.backend, **kwargs)
                    ran = compiled[0].stats["compile"]
                    if not ran["compiled"]:
                        raise SystemExit(f"{policy} did not compile: {ran['eager_reason']}")
                    compilations, seconds = compilations + ran["compilations"], seconds + ran["warmup_seconds"]
                    for a, b in zip(eager, compiled, strict=True):
                        differences.append(first_difference(a.token_ids, b.token_ids))
                others = sorted(d for d in differences if d is not None)
                where = f"{others} (median {statistics.median(others)})" if others else "-"
                size = len(batches[0])
                print(
                    f"| {dtype} | {policy} | {size} | {differences.count(None)} of {len(prompts)} | {where} "
                    f"| {compilations} ({seconds:.0f} s) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
