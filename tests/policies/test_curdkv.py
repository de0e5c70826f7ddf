"""CurDKV leverage maths (against QR/SVD references) and the sketch's lifetime in curdkv / vase-dkv."""

from __future__ import annotations

import math

import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies.leverage import dkv_scores, gaussian_projection, leverage_scores, local_normalise

# --------------------------------------------------------------------------- leverage maths


def _qr_leverage(x: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(x.double())
    return (q**2).sum(-1)


def _svd_leverage(x: torch.Tensor, rank: int) -> torch.Tensor:
    u, _, _ = torch.linalg.svd(x.double(), full_matrices=False)
    return (u[:, :rank] ** 2).sum(-1)


def test_orthonormal_leverage_equals_qr_on_a_full_rank_sketch():
    torch.manual_seed(0)
    x = torch.randn(12, 6)
    g = torch.randn(6, 4) / 2.0
    sketch = x @ g
    got = leverage_scores(sketch.view(1, 1, 12, 4), torch.ones(1, 12, dtype=torch.bool), method="orthonormal")
    torch.testing.assert_close(got[0, 0].double(), _qr_leverage(sketch), atol=1e-5, rtol=0)
    assert math.isclose(float(got.sum()), 4.0, abs_tol=1e-4)  # leverage sums to the rank


def test_orthonormal_leverage_equals_svd_on_a_rank_deficient_sketch():
    torch.manual_seed(1)
    x = torch.randn(12, 3) @ torch.randn(3, 6)  # rank 3, like head_dim < r or few tokens
    sketch = x @ torch.randn(6, 5)
    got = leverage_scores(sketch.view(1, 1, 12, 5), torch.ones(1, 12, dtype=torch.bool), method="orthonormal")
    torch.testing.assert_close(got[0, 0].double(), _svd_leverage(sketch, 3), atol=1e-4, rtol=0)


def test_leverage_ignores_padding_rows_whatever_they_hold():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 10, 4)  # [rows, heads, slots, c]
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False  # row 1: 3 padding slots (holding garbage)
    for method in ("orthonormal", "columns", "norm"):
        got = leverage_scores(x, valid, method=method)
        assert torch.all(got[1, :, :3] == 0)
        alone = leverage_scores(x[1:, :, 3:], torch.ones(1, 7, dtype=torch.bool), method=method)
        torch.testing.assert_close(got[1:, :, 3:], alone, atol=1e-5, rtol=0)
    for head in range(3):
        want = _qr_leverage(x[1, head, 3:])
        got = leverage_scores(x, valid, method="orthonormal")[1, head, 3:]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_column_normalised_and_norm_leverage_follow_their_formulas():
    torch.manual_seed(3)
    y = torch.randn(9, 4) * torch.tensor([1.0, 5.0, 0.1, 2.0])
    valid = torch.ones(1, 9, dtype=torch.bool)
    columns = leverage_scores(y.view(1, 1, 9, 4), valid, method="columns")[0, 0]
    want = sum((y[:, j] / y[:, j].norm()) ** 2 for j in range(4))
    torch.testing.assert_close(columns, want, atol=1e-6, rtol=0)
    norm = leverage_scores(y.view(1, 1, 9, 4), valid, method="norm")[0, 0]
    torch.testing.assert_close(norm, (y**2).sum(-1), atol=1e-5, rtol=0)
    # With orthogonal columns, column normalisation *is* orthonormalisation: the true leverage.
    q, _ = torch.linalg.qr(torch.randn(9, 4))
    orthogonal = q * torch.tensor([3.0, 0.5, 7.0, 1.0])
    got = leverage_scores(orthogonal.view(1, 1, 9, 4), valid, method="columns")[0, 0]
    torch.testing.assert_close(got.double(), _qr_leverage(orthogonal), atol=1e-5, rtol=0)


def _local_reference(scores: list[float], window: int) -> list[float]:
    """Windows of `window` tokens counted back from the newest one; each score over its window's sum."""
    out = [0.0] * len(scores)
    end = len(scores)
    while end > 0:
        start = max(0, end - window)
        total = sum(scores[start:end])
        for i in range(start, end):
            out[i] = scores[i] / total
        end = start
    return out


def test_local_normalisation_windows_count_back_from_the_newest_token_and_skip_padding():
    torch.manual_seed(4)
    real = torch.rand(11) + 0.1
    want = torch.tensor(_local_reference(real.tolist(), 4))
    got = local_normalise(real.view(1, 1, 11), torch.ones(1, 11, dtype=torch.bool), 4)[0, 0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    padded = torch.cat([torch.full((5,), 9.0), real]).view(1, 1, 16)
    valid = torch.cat([torch.zeros(5, dtype=torch.bool), torch.ones(11, dtype=torch.bool)]).view(1, 16)
    got_padded = local_normalise(padded, valid, 4)[0, 0]
    assert torch.all(got_padded[:5] == 0)
    torch.testing.assert_close(got_padded[5:], want, atol=1e-6, rtol=0)
    whole = local_normalise(real.view(1, 1, 11), torch.ones(1, 11, dtype=torch.bool), 0)[0, 0]
    torch.testing.assert_close(whole, real / real.sum(), atol=1e-6, rtol=0)


def test_dkv_scores_multiply_locally_normalised_key_and_value_leverage():
    torch.manual_seed(5)
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    valid = torch.ones(1, 20, dtype=torch.bool)
    g = torch.randn(1, 2, 8, 3)
    got = dkv_scores(keys, values, valid, key_projection=g, value_projection=g, local_window=5)
    for head in range(2):
        k = _column_leverage(keys[0, head] @ g[0, head])
        v = _column_leverage(values[0, head] @ g[0, head])
        want = torch.tensor(_local_reference(k.tolist(), 5)) * torch.tensor(_local_reference(v.tolist(), 5))
        torch.testing.assert_close(got[0, head], want, atol=1e-5, rtol=1e-4)
    key_only = dkv_scores(keys, values, valid, key_projection=g, value_projection=g, local_window=5, combine="key")
    assert torch.allclose(key_only.sum(-1), torch.full((1, 2), 4.0))  # 4 windows of 5, each sums to 1


def _column_leverage(y: torch.Tensor) -> torch.Tensor:
    return ((y / y.norm(dim=0, keepdim=True)) ** 2).sum(-1)


def test_gaussian_projection_scale_and_per_row_streams():
    g = gaussian_projection(torch.tensor([10, 11]), heads=4, dim=32, rank=20)
    assert g.shape == (2, 4, 32, 20)
    assert abs(float(g.std()) - 1 / math.sqrt(20)) < 0.02
    assert abs(float(g.mean())) < 0.01
    alone = gaussian_projection(torch.tensor([11]), heads=4, dim=32, rank=20)
    assert torch.equal(g[1], alone[0])  # a row's sketch does not depend on the batch around it
    assert not torch.equal(g[0], g[1])
    assert not torch.equal(g, gaussian_projection(torch.tensor([10, 11]), heads=4, dim=32, rank=20, stream=1))


# --------------------------------------------------------------------------- the sketch's lifetime


def _projections_per_eviction(name: str, seed: int, **options) -> list[torch.Tensor]:
    """Run a tiny model; return the layer-0 key sketch used at each eviction."""
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    seen: list[torch.Tensor] = []
    with reasonkv.EvictingCache(16, 4, model=model, policy=name, seed=seed, **options) as cache:
        policy = cache.evictor.policy
        original = policy.keep

        def keep(view):
            kept = original(view)
            if view.layer == 0:
                projection = policy.projections[0]
                seen.append(None if projection is None else projection[0].clone())
            return kept

        policy.keep = keep
        ids = torch.tensor([tokenizer("A prompt for sketching.")["input_ids"]])
        model.generate(ids, max_new_tokens=24, do_sample=False, **{cache_keyword(model): cache})
    assert len(seen) >= 4
    return seen


@pytest.mark.slow
def test_vase_dkv_draws_a_new_sketch_at_every_eviction_reproducibly():
    run = _projections_per_eviction("vase-dkv", seed=3)
    for before, after in zip(run[:-1], run[1:], strict=True):
        assert not torch.allclose(before, after)
    again = _projections_per_eviction("vase-dkv", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(run, again, strict=True))
    other = _projections_per_eviction("vase-dkv", seed=4)
    assert not torch.allclose(run[0], other[0])
    assert abs(float(torch.cat([g.flatten() for g in run]).std()) - 1 / math.sqrt(20)) < 0.02


@pytest.mark.slow
def test_curdkv_keeps_one_sketch_per_run_drawn_from_the_seed():
    run = _projections_per_eviction("curdkv", seed=3)
    assert all(torch.equal(run[0], g) for g in run[1:])
    again = _projections_per_eviction("curdkv", seed=3)
    assert torch.equal(run[0], again[0])
    assert not torch.allclose(run[0], _projections_per_eviction("curdkv", seed=4)[0])
    assert _projections_per_eviction("curdkv", seed=3, rank=0)[0] is None  # no sketch: deterministic


@pytest.mark.parametrize("leverage", ["columns", "orthonormal", "norm"])
def test_curdkv_matches_top_k_of_its_reference_scores(leverage):
    """The kept set of one eviction is the top-K of the reference DKV score (independent formulas)."""
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    checked = []
    with reasonkv.EvictingCache(16, 4, model=model, policy="curdkv", seed=0, leverage=leverage) as cache:
        policy = cache.evictor.policy
        original = policy.keep

        def keep(view):
            kept = original(view)
            g, _ = policy.projections[view.layer]
            keys, values, protected = view.keys()[0], view.values()[0], view.protected()[0]
            for head in range(keys.shape[0]):
                k = _reference_leverage(keys[head] @ g[0, head], leverage)
                v = _reference_leverage(values[head] @ g[0, head], leverage)
                score = torch.tensor(_local_reference(k.tolist(), 16)) * torch.tensor(_local_reference(v.tolist(), 16))
                score[protected[head]] = float("inf")
                want = score.topk(view.budget).indices.sort().values
                assert kept[0, head].tolist() == want.tolist()
            checked.append(view.layer)
            return kept

        policy.keep = keep
        ids = torch.tensor([tokenizer("Reference scores, please.")["input_ids"]])
        model.generate(ids, max_new_tokens=8, do_sample=False, **{cache_keyword(model): cache})
    assert checked


def _reference_leverage(y: torch.Tensor, method: str) -> torch.Tensor:
    if method == "columns":
        return _column_leverage(y)
    if method == "norm":
        return (y**2).sum(-1)
    # Numerical rank at the policy's cut-off: the sketch of 16-dim keys through a 16 x 20 G has rank 16.
    return _svd_leverage(y, int(torch.linalg.matrix_rank(y.double(), rtol=1e-5))).float()


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(rank=-1), "rank must be a non-negative integer"),
        (dict(local_window=1.5), "option local_window=1.5: expected int"),
        (dict(leverage="svd"), "leverage must be one of columns, orthonormal, norm"),
        (dict(combine="sum"), "combine must be one of product, mean, key, value"),
    ],
)
def test_bad_dkv_options_are_clear_errors(options, match):
    for name in ("curdkv", "vase-dkv"):
        with pytest.raises(ValueError, match=f"{name}: {match}"):
            reasonkv.get_policy(name, **options)
