"""Fidelity of selection and eviction cells against the K/V bytes each held and read per decode step.

Usage: summarise.py TABLE.md PLOT.png RESULTS.jsonl...

Reads the fidelity records of the given files (uniform allocations only; a cell is a policy and a budget)
and writes a markdown table and a two-panel plot: top-1 agreement with the full cache against the MB of
K/V held per decode step, and against the MB read per step. Both byte counts are the records' measured
``kv_bytes_held_per_step`` and ``kv_bytes_read_per_step`` (means over each replay's steps), averaged over
problems weighted by their steps, as top-1 agreement and KL are.
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SELECTION = ("quest", "seer")
SHOWN = (*SELECTION, "h2o", "vase-attnv", "triattention")  # the comparison; other cells are left out
COLOURS = {"quest": "#E69F00", "seer": "#D55E00", "h2o": "#0072B2", "vase-attnv": "#009E73", "triattention": "#CC79A7"}


def cells(paths):
    found = defaultdict(dict)
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle]
        for record in records:
            if record.get("kind") != "fidelity" or record.get("allocation", "uniform") not in (None, "uniform"):
                continue
            key = (record["dataset"], record["problem_id"])
            if record["policy"] not in SHOWN:
                continue
            label = record.get("policy_label") or record["policy"]  # its options named: triattention[stats=bundled]
            found[(label, record["budget"])][key] = record  # a later file's record of a problem wins
    return found


def _table(rows):
    lines = [
        "| policy | K | kind | top-1 agreement | mean KL | K/V held per step (MB) | K/V read per step (MB) "
        "| problems |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (policy, budget), row in sorted(
        rows.items(), key=lambda item: (item[0][1], item[0][0].split("[")[0] not in SELECTION)
    ):
        kind = "selection (holds all)" if policy.split("[")[0] in SELECTION else "eviction"
        lines.append(
            f"| {policy} | {budget} | {kind} | {row['top1']:.3f} | {row['kl']:.3f} | {row['held']:.2f} | "
            f"{row['read']:.2f} | {row['problems']} |"
        )
    return lines


def summary(records):
    steps = sum(r["trace_tokens"] for r in records)

    def mean(field):
        return sum(r[field] * r["trace_tokens"] for r in records) / steps

    return {
        "top1": mean("top1_agreement"),
        "kl": mean("kl_mean"),
        "held": mean("kv_bytes_held_per_step") / 1e6,
        "read": mean("kv_bytes_read_per_step") / 1e6,
        "problems": len(records),
        "steps": steps,
    }


def main(table_path, plot_path, *paths):
    found = cells(paths)
    datasets = sorted({dataset for records in found.values() for dataset, _ in records})
    widest = {d: max(sum(1 for key in records if key[0] == d) for records in found.values()) for d in datasets}
    scopes = [(d, [d]) for d in datasets] + [("all", datasets)]
    text, plotted = [], {}
    for name, chosen in scopes:
        rows = {}
        for cell, records in found.items():
            mine = [r for (dataset, _), r in records.items() if dataset in chosen]
            if all(sum(1 for r in mine if r["dataset"] == d) == widest[d] for d in chosen):  # complete cells only
                rows[cell] = summary(mine)
        if not rows:
            continue
        plotted = rows if name == "all" or not plotted else plotted
        text += [f"{name}:", "", *_table(rows), ""]
    with open(table_path, "w", encoding="utf-8") as out:
        out.write("\n".join(text))
    rows = plotted

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    panels = (("held", "K/V held per decode step (MB)"), ("read", "K/V read per decode step (MB)"))
    for ax, (field, label) in zip(axes, panels, strict=True):
        for (policy, budget), row in rows.items():
            marker = "o" if budget == min(b for _, b in rows) else "s"
            ax.scatter(row[field], row["top1"], color=COLOURS.get(policy.split("[")[0], "grey"), marker=marker, s=50)
            below = policy.startswith("seer")  # quest and seer sit on one another: one label above, one below
            label_text = f"{policy.split('[')[0]} K={budget}"
            offset = (4, -9 if below else 3)
            ax.annotate(label_text, (row[field], row["top1"]), fontsize=7, xytext=offset, textcoords="offset points")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with the full cache")
    fig.suptitle("SmolLM2-135M, GSM8K 40 + MATH-500 20: selection (holds all) against eviction")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
