"""What ``batch_vs_alone.py`` and ``compiled_vs_eager.py`` share: their settings, the models and prompts
they decode, and how they summarise where rows differ."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator

import torch

import reasonkv
from reasonkv.eval.datasets import load_dataset
from reasonkv.generation.chat import chat_prompt


def parser(description: str, policies: str) -> argparse.ArgumentParser:
    """The settings both scripts take; ``policies``: the default of ``--policies``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--policies", default=policies)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def cases(args: argparse.Namespace) -> Iterator[tuple]:
    """Per dtype and policy: ``(dtype, policy, model, tokenizer, prompts, generate's keyword arguments)``,
    the prompts being the first ``--prompts`` GSM8K questions, chat-formatted (one model load per dtype)."""
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        model, tokenizer = reasonkv.load_model(args.model, dtype=dtype)
        prompts = [chat_prompt(tokenizer, p.problem) for p in load_dataset("gsm8k", limit=args.prompts)]
        for policy in args.policies.split(","):
            kwargs = dict(
                policy=policy,
                budget=None if policy == "full" else args.budget,
                buffer=args.buffer,
                max_new_tokens=args.max_new_tokens,
            )
            yield dtype, policy, model, tokenizer, prompts, kwargs


def where_they_differ(differences: list[int | None]) -> str:
    """The first differing tokens of the rows that differ (``None``: identical), sorted, with their median."""
    others = sorted(d for d in differences if d is not None)
    return f"{others} (median {statistics.median(others)})" if others else "-"
