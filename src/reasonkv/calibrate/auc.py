"""Signal comparison: each score's mean per-trace AUC at telling a trace's top-``fraction`` chunks by label from
the rest, with a bootstrap interval over traces, and its mean per-trace Spearman correlation (docs/calibrate.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from reasonkv.calibrate.stats import auc, bootstrap_indices, interval, nanmean_rows, spearman, top_fraction

__all__ = ["AucRow", "auc_table", "trace_auc"]


def trace_auc(scores: np.ndarray, labels: np.ndarray, fraction: float = 0.2) -> float:
    """AUC of one trace's chunk scores for its top-``fraction`` chunks by label (``NaN`` if undefined)."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float)
    defined = ~np.isnan(labels)
    if defined.sum() < 2:
        return float("nan")
    positives = top_fraction(labels[defined], fraction)
    return auc(scores[defined], positives)


@dataclass(frozen=True)
class AucRow:
    """One score's result: mean per-trace AUC with its interval, mean Spearman, traces used."""

    name: str
    auc: float
    low: float
    high: float
    spearman: float
    traces: int

    def to_dict(self) -> dict[str, object]:
        numbers = {k: getattr(self, k) for k in ("auc", "low", "high", "spearman")}
        return {**asdict(self), **{k: None if np.isnan(v) else round(float(v), 6) for k, v in numbers.items()}}


def auc_table(
    scores: Sequence[Mapping[str, np.ndarray]],
    labels: Sequence[np.ndarray],
    *,
    fraction: float = 0.2,
    replicates: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> list[AucRow]:
    """One :class:`AucRow` per score name (in the order of the first trace's mapping), best AUC first:
    ``scores[i]`` maps names to trace ``i``'s chunk scores, ``labels[i]`` are its chunk labels."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} score sets for {len(labels)} label arrays")
    if not scores:
        return []
    names = list(scores[0])
    indices = bootstrap_indices(len(labels), replicates, seed)
    rows = []
    for name in names:
        aucs = np.array([trace_auc(s[name], y, fraction) for s, y in zip(scores, labels, strict=True)])
        rhos = np.array([spearman(s[name], y) for s, y in zip(scores, labels, strict=True)])
        used = ~np.isnan(aucs)
        mean = float(aucs[used].mean()) if used.any() else float("nan")
        low, high = interval(nanmean_rows(aucs[:, None], indices), level)
        rho = float(np.nanmean(rhos)) if (~np.isnan(rhos)).any() else float("nan")
        rows.append(AucRow(name, mean, float(low[0]), float(high[0]), rho, int(used.sum())))
    return sorted(rows, key=lambda r: (-np.nan_to_num(r.auc, nan=-1.0), r.name))
