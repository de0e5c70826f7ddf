"""Budget tables per (layer, kv-head): they sum to K x layers x kv-heads, and bad settings or files are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from reasonkv.cache import CacheSpec
from reasonkv.cache.allocation import ALLOCATIONS, apportion, budget_table, pyramid_table

SHAPES = [(1, 1, 1), (5, 1, 1), (12, 3, 2), (64, 30, 3), (7, 5, 1), (100, 1, 4), (5, 4, 2), (300, 24, 8), (33, 7, 5)]


@pytest.mark.parametrize(("budget", "layers", "heads"), SHAPES)
@pytest.mark.parametrize("protected", [0, 4])
def test_pyramid_sums_to_the_uniform_total_and_falls_with_depth(budget, layers, heads, protected):
    if budget < protected:
        pytest.skip("the spec refuses a budget below the protected tokens")
    table = pyramid_table(budget, layers, heads, protected)
    assert table.shape == (layers, heads) and table.dtype == torch.long
    assert int(table.sum()) == budget * layers * heads
    assert bool((table >= max(protected, 1) if budget >= 1 else table >= 0).all())
    per_layer = table[:, 0]
    assert bool((table == per_layer.view(-1, 1)).all())  # the same in every head of a layer
    assert bool((per_layer[1:] <= per_layer[:-1]).all())  # falls with depth
    if layers > 1 and budget >= 40:
        assert int(per_layer[0]) > budget > int(per_layer[-1])


def _kvcache_factory_ends(capacity, window, length, layers, beta=20):
    """PyramidKVCluster.update_kv's first and last layer capacities (window included), or None for its
    branches that keep every layer at the same count (a sequence shorter than 2 (capacity - window))."""
    if length < (capacity - window) * 2:
        return None
    min_num = (capacity - window) // beta
    max_num = (capacity - window) * 2 - min_num
    if max_num >= length - window:
        max_num = length - window
        min_num = (capacity - window) * 2 - max_num
    steps = (max_num - min_num) // (layers - 1)
    return max_num + window, max_num - (layers - 1) * steps + window


@pytest.mark.parametrize(
    ("budget", "protected", "length"),
    [(64, 4, None), (128, 0, 5000), (128, 32, 192), (128, 32, 200), (128, 32, 230), (300, 8, 584), (128, 0, 200)],
)
def test_pyramid_follows_kvcache_factorys_schedule(budget, protected, length):
    table = pyramid_table(budget, 30, 3, protected, length)
    assert int(table.sum()) == budget * 30 * 3
    ends = _kvcache_factory_ends(budget, protected, 10**9 if length is None else length, 30)
    if ends is None:  # a short sequence: every layer keeps K
        assert bool((table == budget).all())
        return
    first, last = ends
    assert int(table[0, 0]) == first
    # Its min_num is our last layer's (window on top); its step rounded down leaves its last layer up to 28 above.
    assert int(table[-1, 0]) == 2 * (budget - protected) - (first - protected) + protected
    assert last - 28 <= int(table[-1, 0]) <= last


def test_at_200_tokens_seen_pyramid_holds_what_uniform_holds():
    table = pyramid_table(128, 30, 1, 0, length=200)
    assert int(table.sum()) == 3840 and bool((table.clamp(max=200) == table).all())


@pytest.mark.parametrize("seed", range(20))
def test_apportion_is_exact_and_proportional(seed):
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=generator))
    weights = torch.rand(n, generator=generator) * (torch.rand(n, generator=generator) > 0.3)
    floor = int(torch.randint(0, 5, (1,), generator=generator))
    total = n * floor + int(torch.randint(0, 500, (1,), generator=generator))
    got = apportion(weights, total, floor)
    assert int(got.sum()) == total and bool((got >= floor).all())
    if float(weights.sum()) > 0:  # within one token of the exact share
        exact = weights.double() / weights.double().sum() * (total - n * floor) + floor
        assert float((got.double() - exact).abs().max()) < 1.0


def test_uniform_and_adaptive_tables_are_k_everywhere():
    for allocation in ("uniform", "adaptive"):
        assert bool((budget_table(allocation, 9, 4, 3) == 9).all())


def _write(tmp_path, data, name="budgets.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_calibrated_budgets_and_weights(tmp_path):
    budgets = [[10, 2], [6, 6], [4, 8]]  # 36 = 6 x 3 layers x 2 heads
    spec = CacheSpec.build("h2o", 6, 4, sinks=2, allocation="calibrated", budgets_file=_write(tmp_path, _file(budgets)))
    assert spec.budget_table(3, 2).tolist() == budgets
    weights = [[0.5, 0.0], [0.1, 0.1], [0.2, 0.1]]
    path = _write(tmp_path, {"layers": 3, "kv_heads": 2, "weights": weights}, "weights.json")
    table = CacheSpec.build("h2o", 20, 4, allocation="calibrated", budgets_file=path).budget_table(3, 2)
    assert int(table.sum()) == 20 * 6 and bool((table >= 4).all())  # h2o protects 4 sinks
    assert int(table[0, 0]) == int(table.max()) and int(table[0, 1]) == 4


def _file(budgets):
    return {"layers": len(budgets), "kv_heads": len(budgets[0]), "budgets": budgets, "model": "tiny"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_file([[10, 2], [6, 6], [4, 9]]), "the budgets sum to 37, but K x layers x kv-heads = 6 x 3 x 2 = 36"),
        (_file([[10, 2], [6, 6], [-1, 13]]), "budgets[2][0] is negative (-1)"),
        (_file([[10, 2], [6, 6], [4, 8.5]]), "budgets[2][1] must be an integer, got 8.5"),
        ({"layers": 3, "kv_heads": 2, "budgets": [[10, 2], [6, 6]]}, "'budgets' must list 3 layers, got 2"),
        ({"layers": 3, "kv_heads": 2, "budgets": [[10, 2], [6, 6], [4, 4, 4]]}, "layer 2 must list 2 kv-heads, got 3"),
        ({"layers": 0, "kv_heads": 2, "budgets": []}, "'layers' must be a positive integer, got 0"),
        ({"layers": 1, "kv_heads": 1}, "exactly one of 'budgets' or 'weights'"),
        ({"layers": 1, "kv_heads": 1, "weights": [[-0.5]]}, "weights[0][0] is negative (-0.5)"),
        ({"layers": 1, "kv_heads": 1, "weights": [["a"]]}, "weights[0][0] must be a finite number, got 'a'"),
        (_file([[33, 2], [0, 1], [0, 0]]), "a head's budget of 0 is below the policy's 1 protected tokens"),
        ("[1, 2", "is not JSON"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_a_bad_budget_file_is_refused_with_what_is_wrong(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=re.escape(message)):
        CacheSpec.build("h2o", 6, 4, sinks=1, allocation="calibrated", budgets_file=path)


def test_a_budget_file_for_another_model_is_refused(tmp_path):
    path = _write(tmp_path, _file([[10, 2], [6, 6], [4, 8]]))
    spec = CacheSpec.build("h2o", 6, 4, sinks=0, allocation="calibrated", budgets_file=path)
    with pytest.raises(ValueError, match=re.escape("is for 3 layers x 2 kv-heads, but the model has 4 full-attention")):
        spec.budget_table(4, 2)
    with pytest.raises(ValueError, match="cannot read the budget file"):
        CacheSpec.build("h2o", 6, allocation="calibrated", budgets_file=str(tmp_path / "missing.json"))


def test_allocation_settings_are_checked():
    with pytest.raises(ValueError, match="must be one of uniform, pyramid, adaptive, calibrated, got .even."):
        CacheSpec.build("h2o", 8, allocation="even")
    with pytest.raises(ValueError, match="needs a budget file"):
        CacheSpec.build("h2o", 8, allocation="calibrated")
    with pytest.raises(ValueError, match="budgets_file='x.json' .--budgets-file. does not apply to allocation 'pyr"):
        CacheSpec.build("h2o", 8, allocation="pyramid", budgets_file="x.json")
    with pytest.raises(ValueError, match=re.escape("adaptive_alpha must be a number in [0, 1], got 1.5")):
        CacheSpec.build("h2o", 8, allocation="adaptive", adaptive_alpha=1.5)
    with pytest.raises(ValueError, match="cannot be combined with a quantized tier"):
        CacheSpec.build("h2o", 8, allocation="pyramid", quantized=32)
    assert CacheSpec.build("full", allocation="pyramid").allocation == "uniform"  # nothing to allocate
    assert set(ALLOCATIONS) == {"uniform", "pyramid", "adaptive", "calibrated"}
    assert not CacheSpec.build("h2o", 8).allocated and CacheSpec.build("h2o", 8, allocation="adaptive").allocated
