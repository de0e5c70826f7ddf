"""Fidelity at equal K/V bytes: full-precision tokens only, against fewer of them plus a quantized tier
(``python -m reasonkv.cli.equal_bytes``; docs/quantized-tier.md).

A cell's byte budget is measured (``steady_kv_tokens``, averaged over its problems). A tier's measured bytes
are not its nominal ones (pending tokens wait at full precision), so :func:`tier_sizes` fits the ``Q`` that
holds a byte budget from a calibration run's measured points.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from reasonkv.eval.record_kinds import FidelityRecord
from reasonkv.eval.report import load_results
from reasonkv.eval.report_rows import average, finite

__all__ = ["Cell", "cells", "markdown", "plot", "tier_sizes", "write_tables"]

PLAIN = "full precision"
_ORDER = {PLAIN: 0, "int8": 1, "int4": 2}  # the variants' order in tables and legends; others after them


@dataclass(frozen=True)
class Cell:
    """The mean fidelity of one (dataset, policy, byte budget, variant) over its problems."""

    dataset: str
    policy: str
    bytes_budget: int  # the measured bytes, rounded, in full-precision tokens per (layer, kv-head)
    variant: str  # "full precision", "int8" or "int4"
    budget: int  # K of the cell
    quantized: int  # Q of the cell
    top1: float
    kl: float
    problems: int
    measured: float = math.nan  # the measured bytes, in full-precision tokens (mean over problems)
    nominal: float = math.nan  # the nominal bytes (tiers.equivalent_budget), in the same unit


def _measured_records(records: Iterable[dict]) -> dict[tuple, list[dict]]:
    """Fidelity records with measured steady bytes, by (dataset, policy, variant, K, Q)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") != FidelityRecord.kind or not finite(r.get("steady_kv_tokens")):
            continue
        tier = r.get("tier")
        variant, quantized = (PLAIN, 0) if not tier else (f"int{tier['bits']}", int(tier["quantized"]))
        groups[(r["dataset"], r["policy"], variant, r["budget"], quantized)].append(r)
    return groups


def cells(records: Iterable[dict]) -> list[Cell]:
    """Fidelity records grouped into cells by their measured bytes (records without ``steady_kv_tokens``,
    a row never evicted or a run before it was measured, are skipped)."""
    out = []
    for (dataset, policy, variant, budget, quantized), group in _measured_records(records).items():
        top1 = average([r["top1_agreement"] for r in group if finite(r.get("top1_agreement"))])
        kl = average([r["kl_mean"] for r in group if finite(r.get("kl_mean"))])
        measured = average([r["steady_kv_tokens"] for r in group])
        nominal = average([r["equivalent_budget"] for r in group if finite(r.get("equivalent_budget"))])
        out.append(
            Cell(dataset, policy, round(measured), variant, budget, quantized, top1, kl, len(group), measured, nominal)
        )
    return sorted(out, key=lambda c: (c.dataset, c.policy, c.bytes_budget, _ORDER.get(c.variant, 3)))


def tier_sizes(records: Iterable[dict], target: float) -> list[dict]:
    """Per (policy, bits, K) measured at two or more ``Q``: the ``Q`` (rounded down) whose measured bytes
    would hold ``target`` full-precision tokens, on the least-squares line through the ``points`` ``(Q, tokens)``;
    each entry a dict of ``policy``, ``bits``, ``budget``, ``quantized`` and ``points``."""
    points: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (_, policy, variant, budget, quantized), group in _measured_records(records).items():
        if variant != PLAIN:
            points[(policy, group[0]["tier"]["bits"], budget)][quantized] += [r["steady_kv_tokens"] for r in group]
    sizes = []
    for (policy, bits, budget), measured in sorted(points.items()):
        xs = sorted(measured)
        if len(xs) < 2:
            continue
        ys = [average(measured[q]) for q in xs]
        mx, my = average(xs), average(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        quantized = math.floor(xs[0] + (target - (my + slope * (xs[0] - mx))) / slope)
        fitted = list(zip(xs, ys, strict=True))
        sizes.append({"policy": policy, "bits": bits, "budget": budget, "quantized": quantized, "points": fitted})
    return sizes


def markdown(table: Sequence[Cell]) -> str:
    """One table per dataset, each policy's cells in the order of their measured bytes."""
    lines = []
    for dataset in sorted({c.dataset for c in table}):
        lines += [f"### {dataset}", ""]
        lines += [
            "Bytes in full-precision tokens per (layer, kv-head): measured (the rows' steady K/V bytes after "
            "each eviction, mean over the problems) and nominal (the tier's formula).",
            "",
            "| policy | variant | K + Q | bytes, measured | bytes, nominal | top-1 | KL | problems |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted((c for c in table if c.dataset == dataset), key=lambda c: (c.policy, c.measured)):
            size = str(c.budget) if not c.quantized else f"{c.budget} + {c.quantized}"
            nominal = f"{c.nominal:.1f}" if math.isfinite(c.nominal) else "-"
            lines.append(
                f"| {c.policy} | {c.variant} | {size} | {c.measured:.1f} | {nominal} | {c.top1:.3f} | {c.kl:.3f} "
                f"| {c.problems} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(table: Sequence[Cell], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Per dataset: top-1 agreement and mean KL against the measured bytes, a column per policy, a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset in sorted({c.dataset for c in table}):
        mine = [c for c in table if c.dataset == dataset]
        policies = sorted({c.policy for c in mine})
        variants = sorted({c.variant for c in mine}, key=lambda v: (_ORDER.get(v, 3), v))
        fig, axes = plt.subplots(2, len(policies), figsize=(3.6 * len(policies), 6.5), squeeze=False)
        for col, policy in enumerate(policies):
            for row, (attr, label) in enumerate((("top1", "top-1 agreement"), ("kl", "mean KL(full || cache)"))):
                ax = axes[row][col]
                for variant in variants:
                    hit = [c for c in mine if (c.policy, c.variant) == (policy, variant)]
                    hit.sort(key=lambda c: c.measured)
                    if hit:
                        ax.plot([c.measured for c in hit], [getattr(c, attr) for c in hit], marker="o", label=variant)
                ax.set_xlabel("K/V bytes, full-precision tokens")
                if col == 0:
                    ax.set_ylabel(label)
                ax.set_title(policy if row == 0 else "")
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{dataset}: fidelity at measured K/V bytes")
        fig.tight_layout()
        path = out_dir / f"equal-bytes-{dataset}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_tables(results: Sequence[str | os.PathLike], out: str | os.PathLike) -> list[Path]:
    """``equal-bytes.md`` and the PNGs of ``results`` in ``out``; the paths written."""
    table = cells(load_results(results))
    if not table:
        raise ValueError("no fidelity records with measured bytes (steady_kv_tokens) in the results")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "equal-bytes.md").write_text(markdown(table), encoding="utf-8")
    return [*plot(table, out), out / "equal-bytes.md"]
