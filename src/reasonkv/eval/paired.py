"""Paired fidelity: each policy's top-1 agreement minus a reference policy's, problem by problem (a trace
hard for one policy is often hard for the other, which means over problems hide).

Per (model, dataset, K, B) cell and policy: mean top-1 and KL over the problems shared with the reference,
the mean paired difference and its 95% bootstrap interval (``python -m reasonkv.cli.paired``). A policy is
named by its label, a tiered one with its tier (``h2o + int4 x 116``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reasonkv.eval.record_kinds import FidelityRecord
from reasonkv.eval.report_rows import MIN_PAIRED, average, finite, paired_interval

__all__ = ["PairedRow", "markdown", "paired_fidelity"]


@dataclass(frozen=True)
class PairedRow:
    """One policy of one cell against the reference, over the problems both have."""

    model: str
    dataset: str
    budget: int
    buffer: int | None
    policy: str
    problems: int
    top1: float
    kl: float
    delta: float  # mean top-1 agreement minus the reference's, paired by problem
    low: float  # the 95% bootstrap interval of delta (nan for the reference and below MIN_PAIRED problems)
    high: float


def _label(record: dict) -> str:
    label = str(record.get("policy_label") or record["policy"])
    tier = record.get("tier")
    return f"{label} + int{tier['bits']} x {tier['quantized']}" if tier else label


def _order(cell: tuple) -> tuple:  # model, dataset, then K and B as numbers
    model, dataset, budget, buffer = cell
    return (str(model), str(dataset), budget, -1 if buffer is None else buffer)


def paired_fidelity(records: Iterable[dict], against: str) -> list[PairedRow]:
    """The rows of every cell that holds ``against``, each cell's in the order of their mean top-1.

    Raises ``ValueError`` naming the policies there are when no cell holds ``against``."""
    cells: dict[tuple, dict[str, dict[tuple, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if r.get("kind") != FidelityRecord.kind or not finite(r.get("top1_agreement")):
            continue
        cell = (r.get("model", "?"), r["dataset"], r["budget"], r.get("buffer"))
        cells[cell][_label(r)][(r["problem_id"], r.get("sample", 0))] = (r["top1_agreement"], r.get("kl_mean"))
    rows = []
    for (model, dataset, budget, buffer), policies in sorted(cells.items(), key=lambda item: _order(item[0])):
        base = policies.get(against)
        if base is None:
            continue
        mine = []
        for policy, scores in policies.items():
            shared = sorted(set(scores) & set(base))
            if not shared:
                continue
            differences = [scores[p][0] - base[p][0] for p in shared]
            top1, delta = average([scores[p][0] for p in shared]), average(differences)
            kl = average([scores[p][1] for p in shared if finite(scores[p][1])])
            low, high = (math.nan, math.nan)
            if len(shared) >= MIN_PAIRED and policy != against:
                low, high = paired_interval(differences)
            mine.append(PairedRow(model, dataset, budget, buffer, policy, len(shared), top1, kl, delta, low, high))
        rows += sorted(mine, key=lambda row: (-row.top1, row.policy))
    if not rows:
        labels = sorted({label for policies in cells.values() for label in policies})
        raise ValueError(f"no fidelity records of the reference policy {against!r}; the policies there are: {labels}")
    return rows


def markdown(rows: Sequence[PairedRow], against: str) -> str:
    """A table per cell: policy, problems, top-1, KL, Δ top-1 to ``against`` and its interval."""
    lines: list[str] = []
    cell = None
    for row in rows:
        if (row.model, row.dataset, row.budget, row.buffer) != cell:
            cell = (row.model, row.dataset, row.budget, row.buffer)
            buffer = "" if row.buffer is None else f", B = {row.buffer}"
            lines += [] if not lines else [""]
            lines += [f"### {row.model}, {row.dataset}, K = {row.budget}{buffer}: against {against}", ""]
            lines += ["| policy | problems | top-1 | KL | Δ top-1 | 95% interval |", "|---|---|---|---|---|---|"]
        interval = f"[{row.low:+.3f}, {row.high:+.3f}]"
        if math.isnan(row.low):
            interval = "reference" if row.policy == against else f"— (fewer than {MIN_PAIRED} problems)"
        lines.append(
            f"| {row.policy} | {row.problems} | {row.top1:.3f} | {row.kl:.4f} | {row.delta:+.3f} | {interval} |"
        )
    return "\n".join(lines) + "\n"
