"""Fidelity of the selection and eviction cells against the tokens each holds and reads per step (per head).

Tokens held and read are computed from each replay's lengths: a replay feeds the trace one token at a
time after the prompt, so at its step i a selection cache holds prompt + i + 1 tokens and reads the current
block and min(K // 64 - 1, complete blocks before it) others (the reading rule the tests check); h2o holds at
most K + B and reads what it holds (its mean held count is given as the midpoint of K and K + B once the
row first reached K + B, before that all tokens).
"""

import json
import sys
from collections import defaultdict

BLOCK = 64


def per_step(prompt: int, trace: int, policy: str, budget: int, buffer: int) -> tuple[float, float]:
    held_sum = read_sum = 0.0
    for i in range(trace):
        held = prompt + i + 1
        if policy in ("quest", "seer"):
            newest = held - 1
            current = newest // BLOCK
            read = min(budget // BLOCK - 1, current) * BLOCK + (newest - current * BLOCK + 1)
        else:
            first = held if held < budget + buffer else None
            held = first if first is not None else budget + buffer / 2
            read = held
        held_sum += held if policy not in ("quest", "seer") else prompt + i + 1
        read_sum += read
    return held_sum / trace, read_sum / trace


cells = defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path, encoding="utf-8"):
        record = json.loads(line)
        if record.get("kind") == "fidelity":
            cells[(record["policy"], record["budget"])].append(record)
print(
    "| policy | K | kind | top-1 agreement | mean KL | tokens held per head (mean over steps) | tokens read per head per step (mean) | problems |"
)
print("|---|---|---|---|---|---|---|---|")
for (policy, budget), records in sorted(cells.items(), key=lambda c: (c[0][1], c[0][0])):
    steps = sum(r["trace_tokens"] for r in records)
    top1 = sum(r["top1_agreement"] * r["trace_tokens"] for r in records) / steps
    kl = sum(r["kl_mean"] * r["trace_tokens"] for r in records) / steps
    held = read = 0.0
    for r in records:
        h, d = per_step(r["prompt_tokens"], r["trace_tokens"], policy, budget, r["buffer"])
        held, read = held + h * r["trace_tokens"], read + d * r["trace_tokens"]
    kind = "selection (holds all)" if policy in ("quest", "seer") else "eviction"
    print(
        f"| {policy} | {budget} | {kind} | {top1:.3f} | {kl:.3f} | {held / steps:.0f} | {read / steps:.0f} | {len(records)} |"
    )
