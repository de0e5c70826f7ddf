"""Does a prompt decode to the same tokens in a batch as alone? Measured per dtype and policy.

    python scripts/batch_vs_alone.py --model smollm2-135m --dtypes fp32,bf16 --policies full,streaming,h2o \
        --prompts 8 --max-new-tokens 128 --budget 64 --buffer 16

Decodes the first ``--prompts`` GSM8K questions (chat-formatted, greedy) once as one left-padded
batch and once each alone, and prints, per dtype and policy, how many rows came out identical and,
for the others, the token at which they first differ.
"""

from __future__ import annotations

from same_tokens import cases, parser, where_they_differ

import reasonkv
from reasonkv.inspect.page import departure as first_difference


def main() -> None:
    args = parser(__doc__.splitlines()[0], policies="full,streaming").parse_args()
    print("| dtype | policy | rows identical | first difference (token) of the others |")
    print("|---|---|---|---|")
    for dtype, policy, model, tokenizer, prompts, kwargs in cases(args):
        together = reasonkv.generate(model, tokenizer, prompts, **kwargs)
        differences = []
        for prompt, row in zip(prompts, together, strict=True):
            [alone] = reasonkv.generate(model, tokenizer, prompt, **kwargs)
            differences.append(first_difference(row.token_ids, alone.token_ids))
        where = where_they_differ(differences)
        print(f"| {dtype} | {policy} | {differences.count(None)} of {len(prompts)} | {where} |", flush=True)


if __name__ == "__main__":
    main()
