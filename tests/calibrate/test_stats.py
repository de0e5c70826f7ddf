"""Ranks, Spearman, AUC and the AUC table against brute-force references written in the test."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from reasonkv.calibrate.auc import auc_table, trace_auc
from reasonkv.calibrate.stats import auc, partial_spearman, rankdata, spearman, top_fraction


def _brute_auc(scores, positives) -> float:
    pos = [s for s, p in zip(scores, positives, strict=True) if p]
    neg = [s for s, p in zip(scores, positives, strict=True) if not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def _pearson(x, y) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def _brute_ranks(values):
    return [sum(1 for w in values if w < v) + (sum(1 for w in values if w == v) + 1) / 2 for v in values]


def test_ranks_average_ties():
    values = [3.0, 1.0, 3.0, 2.0, 3.0, 0.5]
    assert rankdata(np.array(values)).tolist() == _brute_ranks(values)


@pytest.mark.parametrize("seed", range(5))
def test_spearman_is_the_pearson_of_ranks(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, 25).astype(float)  # many ties
    y = x + rng.normal(0, 2, 25)
    y[3] = np.nan
    keep = [i for i in range(25) if i != 3]
    want = _pearson(_brute_ranks([x[i] for i in keep]), _brute_ranks([y[i] for i in keep]))
    assert spearman(x, y) == pytest.approx(want, abs=1e-12)


def test_spearman_undefined_cases():
    assert math.isnan(spearman([1, 2], [2, 1]))
    assert math.isnan(spearman([1, 1, 1, 1], [1, 2, 3, 4]))


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_pairwise_count(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, 15).astype(float)  # ties between classes
    positives = rng.random(15) < 0.3
    positives[0], positives[1] = True, False
    assert auc(scores, positives) == pytest.approx(_brute_auc(scores, positives), abs=1e-12)


def test_auc_small_case_by_hand():
    # positives score 0.9 and 0.4; negatives 0.8, 0.4, 0.1 -> wins: 0.9 beats 3, 0.4 beats 0.1, ties 0.4
    assert auc([0.9, 0.8, 0.4, 0.4, 0.1], [True, False, True, False, False]) == pytest.approx((3 + 1 + 0.5) / 6)


def test_top_fraction_counts_and_ties():
    labels = np.array([0.1, np.nan, 0.5, 0.5, 0.2, 0.0, 0.3, 0.4, 0.05, 0.6])
    mask = top_fraction(labels, 0.2)  # 9 defined -> ceil(1.8) = 2
    assert mask[9] and mask[2] and mask.sum() == 2  # 0.6, then the first of the tied 0.5s
    assert top_fraction(np.array([1.0, 2.0]), 0.2).tolist() == [False, True]


def test_trace_auc_and_table():
    labels = [np.array([5.0, 1.0, 0.0, 2.0, np.nan]), np.array([0.0, 3.0, 1.0, 0.5, 0.2])]
    perfect = [lab.copy() for lab in labels]
    reversed_ = [-lab for lab in labels]
    assert trace_auc(perfect[0], labels[0]) == 1.0
    assert trace_auc(reversed_[1], labels[1]) == 0.0
    scores = [{"perfect": p, "reversed": r, "flat": np.zeros(5)} for p, r in zip(perfect, reversed_, strict=True)]
    rows = {row.name: row for row in auc_table(scores, labels, replicates=200)}
    assert rows["perfect"].auc == 1.0 and rows["reversed"].auc == 0.0 and rows["flat"].auc == 0.5
    assert rows["perfect"].spearman == pytest.approx(1.0) and rows["perfect"].traces == 2
    # the table equals the mean of brute-force per-trace AUCs
    rng = np.random.default_rng(0)
    labels = [rng.random(9) for _ in range(6)]
    scores = [{"s": lab + rng.normal(0, 0.3, 9)} for lab in labels]
    want = np.mean([_brute_auc(s["s"], top_fraction(lab, 0.2)) for s, lab in zip(scores, labels, strict=True)])
    [row] = auc_table(scores, labels, replicates=300)
    assert row.auc == pytest.approx(want, abs=1e-12) and row.low <= row.auc <= row.high


def _residuals(v, c):
    v, c = np.asarray(v, dtype=float), np.asarray(c, dtype=float)
    slope = ((c - c.mean()) * (v - v.mean())).sum() / ((c - c.mean()) ** 2).sum()
    return v - v.mean() - slope * (c - c.mean())


@pytest.mark.parametrize("seed", range(4))
def test_partial_spearman_is_the_correlation_of_rank_residuals(seed):
    rng = np.random.default_rng(seed)
    c = np.arange(14.0)
    x = c + rng.normal(0, 4, 14)
    y = 0.5 * c + x * 0.3 + rng.normal(0, 4, 14)
    rx, ry, rc = (_brute_ranks(list(v)) for v in (x, y, c))
    want = _pearson(list(_residuals(rx, rc)), list(_residuals(ry, rc)))
    assert partial_spearman(x, y, c) == pytest.approx(want, abs=1e-10)


def test_position_control_removes_a_shared_position_trend():
    from reasonkv.calibrate.profile import layer_profile

    rng = np.random.default_rng(0)
    signals, labels = [], []
    for _ in range(40):
        position = np.arange(12.0)
        labels.append(position + rng.normal(0, 2, 12))
        signals.append(np.stack([position + rng.normal(0, 2, 12), labels[-1] + rng.normal(0, 1, 12)]))
    plain = layer_profile(signals, labels, control="none", replicates=200)
    partial = layer_profile(signals, labels, control="position", replicates=200)
    assert plain.low[0] > 0.5  # layer 0 only follows position ...
    assert partial.low[0] < 0 < partial.high[0]  # ... which the control removes
    assert partial.low[1] > 0.3  # layer 1 carries the label itself
