"""Host work of one quiet eager decode step: the aten ops dispatched by reasonkv's whole step (sampling, the
forward through an EvictingCache, the evictor's bookkeeping) against transformers' forward alone with its
own DynamicCache, on a random-weight Llama of the given depth.

    python scripts/quiet_step_ops.py --layers 16 --policies full,streaming,h2o,epikv
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import reasonkv


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--policies", default="full,streaming,h2o,epikv")
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    prompt = [5 + i % 50 for i in range(40)]
    with torch.no_grad():
        cache = DynamicCache()
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        with OpCount() as count:
            model(torch.tensor([[7]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    print(f"transformers forward (DynamicCache): {count.ops} aten ops")
    for policy in args.policies.split(","):
        count, counted = OpCount(), {}

        def around_step_10(step, cache, count=count, counted=counted):
            if step == 9:
                count.__enter__()
            elif step == 10:
                count.__exit__(None, None, None)
                counted["ops"] = count.ops

        budget = None if policy == "full" else args.budget
        reasonkv.generate(
            model,
            None,
            [prompt],
            policy=policy,
            budget=budget,
            buffer=16,
            max_new_tokens=14,
            ignore_eos=True,
            on_step=around_step_10,
        )
        print(f"reasonkv {policy}, whole decode step: {counted['ops']} aten ops")


if __name__ == "__main__":
    main()
