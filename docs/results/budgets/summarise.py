"""Each allocation against its policy's uniform cache: top-1 agreement, paired by problem, with 95% intervals.

Usage: summarise.py TABLE.md RESULTS.jsonl...

The first table has one row per (model, dataset, policy): the uniform cache's mean top-1 agreement with the
full cache, then for each allocation its own and its difference to uniform on the same problems, with the
bootstrap interval of :mod:`reasonkv.eval.paired` (resampling problems). The second gives, per cell, the K/V
bytes held per decode step, measured (``kv_bytes_held_per_step``, the mean over problems): every allocation
has the uniform cache's capacity, but a head with a large budget only fills it once the trace is long enough.
"""

import json
import sys
from collections import defaultdict

from reasonkv.eval.paired import paired_fidelity

ALLOCATIONS = ("uniform", "pyramid", "adaptive", "calibrated")


def main(table_path, *paths):
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records += [r for r in map(json.loads, handle) if r.get("kind") == "fidelity"]
    for r in records:  # a policy as its options name it (triattention[stats=bundled]), without the allocation
        r["base_label"] = str(r.get("policy_label") or r["policy"]).split("~")[0]
        r["allocation"] = r.get("allocation") or "uniform"
    held = defaultdict(list)
    for r in records:
        if r.get("kv_bytes_held_per_step") is not None:
            held[(r["model"], r["dataset"], r["base_label"], r["allocation"])].append(r["kv_bytes_held_per_step"])
    header = "| model | dataset | policy | problems | "
    fidelity = [
        header + " | ".join(["uniform", *(f"{a} (Δ vs uniform)" for a in ALLOCATIONS[1:])]) + " |",
        "|---|---|---|---|" + "---|" * len(ALLOCATIONS),
    ]
    bytes_held = [header + " | ".join(ALLOCATIONS) + " |", "|---|---|---|---|" + "---|" * len(ALLOCATIONS)]
    for policy in sorted({r["base_label"] for r in records}):
        mine = [r for r in records if r["base_label"] == policy]
        labels = {r["allocation"]: r.get("policy_label") or r["policy"] for r in mine}
        for row_set in _by_cell(paired_fidelity(mine, against=labels["uniform"])):
            first = row_set[0]
            by_label = {row.policy: row for row in row_set}
            uniform = by_label[labels["uniform"]]
            if not any(labels.get(a) in by_label for a in ALLOCATIONS[1:]):
                continue  # run under uniform only (an eviction row of another comparison)
            cells, sizes = [f"{uniform.top1:.3f}"], []
            for allocation in ALLOCATIONS[1:]:
                row = by_label.get(labels.get(allocation))
                cells.append(
                    "not run" if row is None else f"{row.top1:.3f} ({row.delta:+.3f} [{row.low:+.3f}, {row.high:+.3f}])"
                )
            for allocation in ALLOCATIONS:
                values = held.get((first.model, first.dataset, policy, allocation))
                sizes.append(f"{sum(values) / len(values) / 1e6:.2f} MB" if values else "not run")
            key = f"| {first.model} | {first.dataset} | {policy} | {uniform.problems} | "
            fidelity.append(key + " | ".join(cells) + " |")
            bytes_held.append(key + " | ".join(sizes) + " |")
    text = (
        "\n".join(fidelity) + "\n\nK/V held per decode step, measured (mean over problems):\n\n" + "\n".join(bytes_held)
    )
    with open(table_path, "w", encoding="utf-8") as out:
        out.write(text + "\n")


def _by_cell(rows):
    groups = defaultdict(list)
    for row in rows:
        groups[(row.model, row.dataset, row.budget)].append(row)
    return [groups[key] for key in sorted(groups)]


if __name__ == "__main__":
    main(*sys.argv[1:])
