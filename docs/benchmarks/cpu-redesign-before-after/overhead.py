"""The bench part side by side: per decode step, the eviction work (record + observe + score + gather, in ms)
and the step's median relative to the full cache of the same tree, before and after."""

import json
import sys
from pathlib import Path

here = Path(__file__).parent


def windows(tree: str) -> dict:
    out = {}
    for line in (here / "bench" / tree / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        for window in record["windows"]:
            out[record["policy"], window["length"]] = window
    return out


before, after = windows("before"), windows("after")
print("| policy | length | eviction work ms/step before | after | after/before | step vs full before | after |")
print("|---|---|---|---|---|---|---|")
for policy, length in sorted(set(before) & set(after), key=lambda k: (k[0] != "full", k)):
    if length not in (1024, 2048):
        continue
    b, a = before[policy, length], after[policy, length]
    ratio = a["eviction_overhead_s"] / b["eviction_overhead_s"] if b["eviction_overhead_s"] else float("nan")
    rel_b = b["step_median_s"] / before["full", length]["step_median_s"]
    rel_a = a["step_median_s"] / after["full", length]["step_median_s"]
    print(
        f"| {policy} | {length} | {1e3 * b['eviction_overhead_s']:.2f} | {1e3 * a['eviction_overhead_s']:.2f}"
        f" | {ratio:.2f} | {rel_b:.2f} | {rel_a:.2f} |"
    )
sys.exit(0)
