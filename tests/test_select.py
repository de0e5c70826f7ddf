"""Pure selection functions: protection, top-k, Gumbel-top-k sampling, value ranges."""

from __future__ import annotations

import pytest
import torch

from reasonkv import select


def test_protected_mask_sinks_window_prompt_and_padding():
    positions = torch.tensor([[-1, -1, 0, 1, 2, 5, 9, 10, 11]])
    newest = torch.tensor([11])
    mask = select.protected_mask(positions, sinks=2, window=2, newest=newest)
    assert mask.tolist() == [[False, False, True, True, False, False, False, True, True]]
    with_prompt = select.protected_mask(positions, sinks=0, window=0, newest=newest, prompt_lengths=torch.tensor([6]))
    assert with_prompt.tolist() == [[False, False, True, True, True, True, False, False, False]]


def test_keep_top_keeps_protected_then_best_and_never_padding():
    scores = torch.tensor([[9.0, 0.1, 5.0, 4.0, 3.0, 8.0]])
    valid = torch.tensor([[False, True, True, True, True, True]])
    protected = torch.tensor([[False, True, False, False, False, False]])
    kept = select.keep_top(scores, valid=valid, protected=protected, k=3)
    assert kept.tolist() == [[1, 2, 5]]  # protected 1, then 8.0 and 5.0; padding slot 0 never


def test_keep_top_per_head_and_nan_scores_rank_last():
    scores = torch.tensor([[[1.0, float("nan"), 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]]])
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    kept = select.keep_top(scores, valid=valid, protected=torch.zeros(1, 2, 4, dtype=torch.bool), k=2)
    assert kept.tolist() == [[[2, 3], [0, 1]]]


def test_too_many_protected_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="3 protected tokens exceed the budget of 2"):
        select.keep_top(
            torch.zeros(1, 5),
            valid=torch.ones(1, 5, dtype=torch.bool),
            protected=torch.tensor([[True, True, True, False, False]]),
            k=2,
        )


def _gens(seed: int, rows: int = 1):
    return [torch.Generator().manual_seed(seed + r) for r in range(rows)]


def test_sampling_is_exact_count_unique_and_reproducible():
    weights = torch.rand(2, 50)
    valid = torch.ones(2, 50, dtype=torch.bool)
    protected = torch.zeros(2, 50, dtype=torch.bool)
    protected[:, 0] = True
    a = select.keep_sampled(weights, valid=valid, protected=protected, k=10, generators=_gens(1, 2))
    b = select.keep_sampled(weights, valid=valid, protected=protected, k=10, generators=_gens(1, 2))
    c = select.keep_sampled(weights, valid=valid, protected=protected, k=10, generators=_gens(7, 2))
    assert a.shape == (2, 10)
    assert all(len(set(row.tolist())) == 10 for row in a)
    assert (a[:, 0] == 0).all()  # protected kept (indices are sorted)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampling_frequency_increases_with_weight():
    weights = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 0.0]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    none = torch.zeros(1, 6, dtype=torch.bool)
    counts = torch.zeros(6)
    for seed in range(400):
        kept = select.keep_sampled(weights, valid=valid, protected=none, k=2, generators=_gens(seed))
        counts[kept[0]] += 1
    assert counts[5] == 0  # zero weight is never drawn while positive weights remain
    assert all(counts[i] < counts[i + 1] for i in range(4)), counts


def test_temperature_flattens_the_distribution():
    weights = torch.tensor([[1.0, 100.0, 1.0, 1.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    none = torch.zeros(1, 4, dtype=torch.bool)

    def hits(t):
        return sum(
            int(
                1
                in select.keep_sampled(weights, valid=valid, protected=none, k=1, generators=_gens(s), temperature=t)[
                    0
                ].tolist()
            )
            for s in range(200)
        )

    assert hits(1.0) > hits(100.0)


def test_value_range():
    values = torch.tensor([[[0.0, 1.0], [-5.0, 5.0], [2.0, 2.5]]])
    assert select.value_range(values).tolist() == [[1.0, 10.0, 0.5]]
