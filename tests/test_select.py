"""Pure selection functions: protection, top-k, Gumbel-top-k sampling, value ranges."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reasonkv.policies import select


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


def _draws(seed: int, rows: int = 1, slots: int = 50):
    """Keyword arguments for keep_sampled: one seed per row, slots at positions 0..slots-1."""
    return {"seeds": torch.arange(seed, seed + rows), "positions": torch.arange(slots).expand(rows, slots)}


def test_sampling_is_exact_count_unique_and_reproducible():
    weights = torch.rand(2, 50)
    valid = torch.ones(2, 50, dtype=torch.bool)
    protected = torch.zeros(2, 50, dtype=torch.bool)
    protected[:, 0] = True
    a = select.keep_sampled(weights, valid=valid, protected=protected, k=10, **_draws(1, 2))
    b = select.keep_sampled(weights, valid=valid, protected=protected, k=10, **_draws(1, 2))
    c = select.keep_sampled(weights, valid=valid, protected=protected, k=10, **_draws(7, 2))
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
        kept = select.keep_sampled(weights, valid=valid, protected=none, k=2, **_draws(seed, slots=6))
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
                in select.keep_sampled(
                    weights, valid=valid, protected=none, k=1, **_draws(s, slots=weights.shape[-1]), temperature=t
                )[0].tolist()
            )
            for s in range(200)
        )

    assert hits(1.0) > hits(100.0)


def test_value_range():
    values = torch.tensor([[[0.0, 1.0], [-5.0, 5.0], [2.0, 2.5]]])
    assert select.value_range(values).tolist() == [[1.0, 10.0, 0.5]]


def test_ties_go_to_the_most_recent_token_the_same_way_every_time():
    """Max-pooled scores have runs of equal values: the kept set must not depend on how a device's topk
    orders ties, so among equal scores the higher slot (the more recent token) is kept."""
    scores = torch.tensor([[5.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 7.0]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    none = torch.zeros(1, 8, dtype=torch.bool)
    assert select.keep_top(scores, valid=valid, protected=none, k=4).tolist() == [[0, 4, 6, 7]]
    ranges = torch.tensor([[3.0, 3.0, 3.0, 1.0, 3.0, 0.0]])
    reserved = select.reserve_top(ranges, valid=torch.ones(1, 6, dtype=torch.bool), protected=none[:, :6], n=2, k=4)
    assert reserved.tolist() == [[False, False, True, False, True, False]]
    assert select.top_indices(torch.zeros(2, 5), 3).tolist() == [[2, 3, 4], [2, 3, 4]]


def test_top_indices_equal_a_stable_sort_over_signs_zeros_infinities_and_ties():
    """The partial selection on tie-broken integer keys picks what a stable full sort picks."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 4, 300, generator=generator) * torch.tensor([1e-30, 1.0, 1e30]).view(3, 1, 1)
    keys[..., 10:40] = 0.25  # a run of ties
    keys[..., 50:60] = -3.0
    keys[..., 60], keys[..., 61], keys[..., 62] = 0.0, -0.0, 0.0  # -0.0 ties with 0.0
    keys[..., 70], keys[..., 71] = float("inf"), float("-inf")
    keys[..., 80:83] = torch.finfo(torch.float32).max  # protected slots' rank
    for k in (1, 7, 35, 150, 299, 300):
        order = torch.sort(keys.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
        want = (299 - order).sort(dim=-1).values
        assert torch.equal(select.top_indices(keys, k), want), k


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the operands of every matrix product run inside the block."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).split(".")[1] in ("mm", "bmm", "matmul", "addmm", "baddbmm"):
            self.seen += [a.dtype for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def _bf16_attention_inputs(device):
    generator = torch.Generator().manual_seed(0)
    queries = (4 * torch.randn(2, 4, 3, 64, generator=generator)).to(device, torch.bfloat16)
    keys = (4 * torch.randn(2, 2, 50, 64, generator=generator)).to(device, torch.bfloat16)
    return queries, keys


def test_recomputed_logits_are_float32_products_as_sdpa_computes_them():
    from reasonkv.policies.attention import grouped_logits

    queries, keys = _bf16_attention_inputs("cpu")
    with _MatmulDtypes() as dtypes:
        logits = grouped_logits(queries, keys, 0.125)
    assert dtypes.seen and set(dtypes.seen) == {torch.float32}
    want = torch.matmul(queries.float().view(2, 2, 6, 64), keys.float().transpose(2, 3)) * 0.125
    torch.testing.assert_close(logits.view(2, 2, 6, 50), want, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA, where a bf16 product rounds to bf16")
def test_recomputed_logits_on_cuda_are_not_rounded_to_the_cache_dtype():
    from reasonkv.policies.attention import grouped_logits

    queries, keys = _bf16_attention_inputs("cuda")
    logits = grouped_logits(queries, keys, 0.125).view(2, 2, 6, 50)
    want = torch.matmul(queries.double().view(2, 2, 6, 64), keys.double().transpose(2, 3)) * 0.125
    # bf16 output rounding alone would move logits of this size by up to about 0.06
    assert float((logits.double() - want).abs().max()) < 1e-3
