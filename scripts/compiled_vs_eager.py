"""Does a compiled decode give the tokens an eager one gives? Measured per dtype, policy and batch size.

    python scripts/compiled_vs_eager.py --model smollm2-135m --dtypes fp32,bf16 \
        --policies streaming,h2o,epikv,snapkv --prompts 8 --max-new-tokens 128 --budget 64 --buffer 16

Decodes the first ``--prompts`` GSM8K questions (chat-formatted, greedy) eagerly and with
``compile=BACKEND`` (default inductor), as one left-padded batch and each alone, and prints, per dtype,
policy and batch size, how many rows came out identical and, for the others, the token at which they
first differ; and the compilations and their seconds (left out of the decode time).
"""

from __future__ import annotations

from same_tokens import cases, parser, where_they_differ

import reasonkv
from reasonkv.inspect.page import departure as first_difference


def main() -> None:
    settings = parser(__doc__.splitlines()[0], policies="streaming,h2o")
    settings.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    args = settings.parse_args()
    print("| dtype | policy | batch | rows identical | first difference (token) of the others | compilations (s) |")
    print("|---|---|---|---|---|---|")
    for dtype, policy, model, tokenizer, prompts, kwargs in cases(args):
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
            print(
                f"| {dtype} | {policy} | {len(batches[0])} | {differences.count(None)} of {len(prompts)} "
                f"| {where_they_differ(differences)} | {compilations} ({seconds:.0f} s) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
