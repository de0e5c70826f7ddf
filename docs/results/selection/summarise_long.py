"""Selection against eviction on long traces: the tables and plot of long_traces.py's records.

Usage: summarise_long.py [LONG.jsonl]   (default: long-traces.jsonl beside this script)

Prints markdown and writes it to long-traces.md beside the JSONL, with long-traces.png (top-1 agreement and KL
against the K/V bytes read per decode step, a marker per cell). Per K, each cell's means over its problems (a
problem counts once, however long its answer) of top-1 agreement with the full cache, KL(full || cache) and the
K/V MB held and read per decode step, its wall seconds, and its top-1 and KL minus vase-attnv's, paired by
problem, with a 95% bootstrap interval (problems resampled, 2,000 replicates, seed 0: the interval of
``python -m reasonkv.cli.paired``; none below 10 shared problems). Then the traces' lengths and the wall time of
the cells. Works on a run under way: the cells of run-long.sh not yet in the file are named as missing.
"""

import json
import math
import statistics
import sys
from pathlib import Path

from reasonkv.eval.report_rows import MIN_PAIRED, paired_interval

POLICIES = ("quest", "seer", "h2o", "vase-attnv", "triattention", "streaming")  # run-long.sh's cells
BUDGETS = (128, 512)
REFERENCE = "vase-attnv"
SELECTION = ("quest", "seer")
COLOURS = {
    "quest": "#E69F00",
    "seer": "#D55E00",
    "h2o": "#0072B2",
    "vase-attnv": "#009E73",
    "triattention": "#CC79A7",
    "streaming": "#56B4E9",
}
MARKERS = {128: "o", 256: "^", 512: "s"}
FIELDS = {"top1": "top1_agreement", "kl": "kl_mean", "held": "kv_bytes_held_per_step", "read": "kv_bytes_read_per_step"}


def load(path: Path) -> tuple[list[dict], dict[tuple[str, int], dict]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    traces = [r for r in records if r["kind"] == "trace"]
    cells = {(r["policy"], r["budget"]): r for r in records if r["kind"] == "cell"}  # a later record wins
    return traces, cells


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def summary(cell: dict, reference: dict | None) -> dict:
    """A cell's means over its problems, and its paired differences to the reference cell (None without one)."""
    rows = {r["problem"]: r for r in cell["rows"]}
    out = {key: _mean(r[field] for r in rows.values()) for key, field in FIELDS.items()}
    out.update(problems=len(rows), seconds=cell["seconds"])
    base = {r["problem"]: r for r in reference["rows"]} if reference else {}
    shared = sorted(set(rows) & set(base))
    for key in ("top1", "kl"):
        differences = [rows[p][FIELDS[key]] - base[p][FIELDS[key]] for p in shared]
        out[f"delta_{key}"] = _mean(differences) if differences else None
        out[f"interval_{key}"] = paired_interval(differences) if len(shared) >= MIN_PAIRED else None
    out["paired"] = len(shared)
    return out


def _delta(row: dict, key: str, policy: str) -> str:
    if policy == REFERENCE:
        return "reference"
    if row[f"delta_{key}"] is None:
        return f"— (no {REFERENCE} cell)"
    text = f"{row[f'delta_{key}']:+.3f}"
    interval = row[f"interval_{key}"]
    return f"{text} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{text} ({row['paired']} problems)"


def table(rows: dict[str, dict]) -> list[str]:
    lines = [
        f"| policy | kind | problems | top-1 agreement | mean KL | K/V held per step (MB) | K/V read per step (MB) "
        f"| seconds | Δ top-1 vs {REFERENCE} [95%] | Δ KL vs {REFERENCE} [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, row in sorted(rows.items(), key=lambda item: (-item[1]["top1"], item[0])):
        kind = "selection (holds all)" if policy in SELECTION else "eviction"
        lines.append(
            f"| {policy} | {kind} | {row['problems']} | {row['top1']:.3f} | {row['kl']:.3f} | {row['held'] / 1e6:.2f} "
            f"| {row['read'] / 1e6:.2f} | {row['seconds']:.0f} | {_delta(row, 'top1', policy)} "
            f"| {_delta(row, 'kl', policy)} |"
        )
    return lines


def lengths(traces: list[dict]) -> list[str]:
    columns = {
        "total": [len(t["prompt"]) + len(t["answer"]) for t in traces],
        "context + prompt": [len(t["prompt"]) for t in traces],
        "answer": [len(t["answer"]) for t in traces],
    }
    lines = ["| tokens | min | Q1 | median | Q3 | max |", "|---|---|---|---|---|---|"]
    for name, values in columns.items():
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        cells = " | ".join(f"{v:,.1f}".removesuffix(".0") for v in (min(values), q1, median, q3, max(values)))
        lines.append(f"| {name} | {cells} |")
    return lines


def plot(summaries: dict[tuple[str, int], dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, (key, label) in zip(
        axes, (("top1", "top-1 agreement with the full cache"), ("kl", "mean KL")), strict=True
    ):
        for (policy, budget), row in summaries.items():
            ax.scatter(row["read"] / 1e6, row[key], color=COLOURS.get(policy, "grey"), marker=MARKERS.get(budget, "D"))
        ax.set_xscale("log")  # the bytes read grow about fourfold from K = 128 to 512
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("K/V read per decode step (MB, log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=p) for p, c in COLOURS.items()]
    budgets = sorted({budget for _, budget in summaries})
    handles += [
        Line2D([], [], color="black", marker=MARKERS.get(b, "D"), linestyle="", label=f"K={b}") for b in budgets
    ]
    axes[1].legend(handles=handles, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(path: Path) -> str:
    traces, cells = load(path)
    budgets = sorted({*BUDGETS, *(budget for _, budget in cells)})
    summaries = {(p, k): summary(cell, cells.get((REFERENCE, k))) for (p, k), cell in cells.items()}
    total = [len(t["prompt"]) + len(t["answer"]) for t in traces]
    span = f"{len(traces)} traces of {min(total):,}-{max(total):,} tokens" if traces else "no traces yet"
    text = [
        "# Selection against eviction on long traces",
        "",
        f"{span}, teacher-forced through each cache (settings in run-long.sh). Means over problems; Δ: paired "
        f"by problem against {REFERENCE}, 95% bootstrap interval (problems resampled, 2,000 replicates, seed 0).",
        "",
    ]
    for budget in budgets:
        rows = {p: row for (p, k), row in summaries.items() if k == budget}
        text += [f"## K = {budget}", ""] + (table(rows) if rows else ["No cell yet."]) + [""]
    if traces:
        text += ["## Trace lengths", "", *lengths(traces), ""]
    missing = [f"{p} K={k}" for k in BUDGETS for p in POLICIES if (p, k) not in cells]
    seconds = {k: sum(c["seconds"] for (_, b), c in cells.items() if b == k) for k in sorted({b for _, b in cells})}
    sampling = max((t.get("seconds", 0.0) for t in traces), default=0.0)  # a trace's seconds: since sampling began
    text += [
        "## Wall time",
        "",
        f"Cells: {len(cells)}, {sum(seconds.values()):,.0f} s in all ("
        + ", ".join(f"K = {k}: {s:,.0f} s" for k, s in seconds.items())
        + f"); sampling the traces: {sampling:,.0f} s.",
        "",
        f"Missing cells: {', '.join(missing)}." if missing else "Every cell of run-long.sh is here.",
        "",
    ]
    image = path.with_name("long-traces.png")
    if summaries and plot(summaries, image, f"Long traces ({span}): fidelity against K/V read per step"):
        text += [f"![top-1 agreement and KL against the K/V read per decode step]({image.name})", ""]
    elif summaries:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    markdown = "\n".join(text)
    path.with_name("long-traces.md").write_text(markdown, encoding="utf-8")
    return markdown


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("long-traces.jsonl")), end="")
