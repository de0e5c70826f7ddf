"""Small statistics in numpy (no scipy or sklearn): ranks, Spearman correlation, AUC and bootstrap intervals over
traces. Missing values are ``NaN``; every function drops them pairwise.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = [
    "auc",
    "bootstrap_indices",
    "interval",
    "nanmean_rows",
    "partial_spearman",
    "rankdata",
    "spearman",
    "top_fraction",
]


def rankdata(values: np.ndarray) -> np.ndarray:
    """Ranks ``1..n`` along the last axis, ties sharing their average rank."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, axis=-1, kind="mergesort")
    sorted_values = np.take_along_axis(values, order, -1)
    n = values.shape[-1]
    ranks_sorted = np.empty(values.shape, dtype=float)
    flat_values = sorted_values.reshape(-1, n)
    flat_ranks = ranks_sorted.reshape(-1, n)
    for row in range(flat_values.shape[0]):
        v = flat_values[row]
        starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
        ends = np.r_[starts[1:], n]
        average = (starts + ends + 1) / 2.0  # mean of the 1-based ranks start+1 .. end
        flat_ranks[row] = np.repeat(average, ends - starts)
    ranks = np.empty_like(ranks_sorted)
    np.put_along_axis(ranks, order, ranks_sorted, -1)
    return ranks


def spearman(x: np.ndarray, y: np.ndarray, min_pairs: int = 3) -> float:
    """Spearman correlation of the pairs where both are defined; ``NaN`` with fewer than ``min_pairs``
    pairs or a constant side."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = ~(np.isnan(x) | np.isnan(y))
    if keep.sum() < min_pairs:
        return float("nan")
    rx, ry = rankdata(x[keep]), rankdata(y[keep])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")


def partial_spearman(x: np.ndarray, y: np.ndarray, control: np.ndarray, min_pairs: int = 4) -> float:
    """Spearman correlation of ``x`` and ``y`` with ``control`` partialled out (ranks, then
    ``(r_xy - r_xc r_yc) / sqrt((1 - r_xc^2)(1 - r_yc^2))``); ``NaN`` with fewer than ``min_pairs`` complete
    triples or when a side is constant or fully explained by ``control``."""
    x, y, c = (np.asarray(v, dtype=float) for v in (x, y, control))
    keep = ~(np.isnan(x) | np.isnan(y) | np.isnan(c))
    if keep.sum() < min_pairs:
        return float("nan")
    r_xy, r_xc, r_yc = (spearman(u[keep], v[keep]) for u, v in ((x, y), (x, c), (y, c)))
    denominator = np.sqrt((1 - r_xc**2) * (1 - r_yc**2))
    if np.isnan(r_xy) or np.isnan(denominator) or denominator < 1e-12:
        return float("nan")
    return float((r_xy - r_xc * r_yc) / denominator)


def top_fraction(labels: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean mask of the ``max(1, ceil(fraction * n))`` largest defined labels (``n`` = defined count), ties at
    the threshold broken by position (earlier first), so exactly that many are marked."""
    labels = np.asarray(labels, dtype=float)
    defined = np.flatnonzero(~np.isnan(labels))
    mask = np.zeros(labels.shape, dtype=bool)
    if defined.size == 0:
        return mask
    count = max(1, int(np.ceil(fraction * defined.size - 1e-9)))
    order = defined[np.argsort(-labels[defined], kind="mergesort")]
    mask[order[:count]] = True
    return mask


def auc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for ``positives`` vs the rest (ties count 1/2; pairs with a ``NaN``
    score dropped); ``NaN`` when either class is empty."""
    scores = np.asarray(scores, dtype=float)
    positives = np.asarray(positives, dtype=bool)
    keep = ~np.isnan(scores)
    scores, positives = scores[keep], positives[keep]
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(scores)
    # Mann-Whitney: the positives' rank sum minus its minimum, over the number of pairs.
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def bootstrap_indices(n: int, replicates: int, seed: int) -> np.ndarray:
    """``[replicates, n]`` indices drawn with replacement (trace resampling)."""
    return np.random.default_rng(seed).integers(0, n, size=(replicates, n))


def nanmean_rows(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Mean over the resampled rows of ``values [n, ...]`` ignoring ``NaN``: ``[replicates, ...]``."""
    sample = values[indices]  # [replicates, n, ...]
    defined = ~np.isnan(sample)
    total = np.where(defined, sample, 0.0).sum(1)
    count = defined.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def interval(replicates: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the first axis (``NaN`` replicates ignored)."""
    tail = (1.0 - level) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column with no defined replicate gives NaN
        low = np.nanquantile(replicates, tail, axis=0)
        high = np.nanquantile(replicates, 1.0 - tail, axis=0)
    return low, high
