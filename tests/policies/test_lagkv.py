"""LagKV: scores against a direct per-chunk loop; chunk quotas, the unscored newest chunks, batching."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from oracle import run_and_check
from reasonkv.hf import cache_keyword
from reasonkv.policies.lagkv import LagKV, lag_relative_scores
from reasonkv.policies.view import EvictionView

TOKENS = [5 + (7 * i + i * i) % 83 for i in range(40)]


def _softmax(xs):
    peak = max(xs)
    e = [math.exp(x - peak) for x in xs]
    return [v / sum(e) for v in e]


def _lag_loop(keys: torch.Tensor, values: torch.Tensor, skip: int, lag: int, value_weight: float = 1.0):
    """LagKV by hand for one head's real tokens ``[n, d]``: {token index: score} of the scored chunks."""
    n, d = keys.shape
    start = min(skip, n)
    chunks = (n - start) // lag
    out = {}
    for c in range(chunks - 1):
        here = list(range(start + c * lag, start + (c + 1) * lag))
        ref = list(range(start + (c + 1) * lag, start + (c + 2) * lag))
        per_state = []
        for states in (keys.double(), values.double()):
            low = [min(float(states[t, ch]) for t in ref) for ch in range(d)]
            high = [max(float(states[t, ch]) for t in ref) for ch in range(d)]
            spread = [
                statistics.stdev((float(states[t, ch]) - low[ch]) / (high[ch] - low[ch]) for ch in range(d))
                for t in here
            ]
            per_state.append(_softmax(spread))
        for i, t in enumerate(here):
            out[t] = per_state[0][i] + value_weight * per_state[1][i]
    return out


def test_scores_equal_a_per_chunk_loop_with_padding():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 2, 31, 6), torch.randn(2, 2, 31, 6) * 3
    valid = torch.ones(2, 31, dtype=torch.bool)
    valid[1, :4] = False  # row 1: four padding slots holding garbage
    raw, scored, rank = lag_relative_scores(keys, values, valid, skip=3, lag=5, value_weight=0.5)
    for row, first in ((0, 0), (1, 4)):
        for head in range(2):
            want = _lag_loop(keys[row, head, first:], values[row, head, first:], 3, 5, 0.5)
            assert sorted(torch.nonzero(scored[row]).flatten().tolist()) == sorted(t + first for t in want)
            got = torch.tensor([raw[row, head, t + first].item() for t in sorted(want)], dtype=torch.float64)
            torch.testing.assert_close(
                got, torch.tensor([want[t] for t in sorted(want)], dtype=torch.float64), atol=1e-5, rtol=1e-5
            )
            for c in range(len(want) // 5):  # ranks order each chunk's scores
                chunk = sorted(want)[c * 5 : (c + 1) * 5]
                order = sorted(chunk, key=want.get)
                assert [int(rank[row, head, t + first]) for t in order] == list(range(5))
    # row 0: (31 - 3) // 5 = 5 chunks, 4 scored; row 1: (27 - 3) // 5 = 4 chunks, 3 scored.
    assert scored.sum(-1).tolist() == [20, 15]
    assert torch.all(raw.masked_select(~scored.unsqueeze(1).expand_as(raw)) == 0)


def test_too_short_rows_score_nothing_and_flat_channels_do_not_divide_by_zero():
    keys = torch.randn(1, 1, 12, 4)
    valid = torch.ones(1, 12, dtype=torch.bool)
    _, scored, _ = lag_relative_scores(keys, keys, valid, skip=4, lag=5)  # 8 tokens after the sinks < 2 * lag
    assert not scored.any()
    keys[:, :, 9:, 0] = 1.0  # channel 0 constant in the reference chunk
    raw, scored, _ = lag_relative_scores(keys, keys, valid, skip=2, lag=5)
    assert scored.sum() == 5 and torch.isfinite(raw).all()


def _prefilled(model, policy):
    cache = reasonkv.EvictingCache(1000, 8, model=model, policy=policy)
    with torch.no_grad():
        model(input_ids=torch.tensor([TOKENS]), use_cache=True, **{cache_keyword(model): cache})
    cache.detach()
    return cache


def _view(cache, layer, budget):
    ev = cache.evictor
    view = EvictionView(
        cache=cache,
        recorded=ev.observer.recorded,
        policy=ev.policy,
        rows=torch.arange(1),
        row_seeds=torch.zeros(1, dtype=torch.long),
        info=ev.info,
    ).at(layer)
    view.budget = budget
    return view


@pytest.mark.parametrize("quota", [True, False])
def test_kept_set_on_a_model_cache(quota):
    """40 tokens, 4 sinks, lag 6: chunks 4..9, ..., 34..39; chunks 0-4 scored, 34..39 unscored."""
    model = tiny_llama(kv_heads=2)
    policy = LagKV(lag=6, quota=quota)
    cache = _prefilled(model, policy)
    for layer in range(model.config.num_hidden_layers):
        view = _view(cache, layer, budget=4 + 6 + 10)
        kept = policy.keep(view)[0]
        keys, values = view.keys()[0], view.values()[0]
        for head in range(2):
            want = _lag_loop(keys[head], values[head], 4, 6)
            assert sorted(want) == list(range(4, 34))
            expected = set(range(4)) | set(range(34, 40))
            if quota:  # the paper's per-chunk top-k: 10 slots over 5 chunks = the best 2 of each
                for c in range(5):
                    chunk = range(4 + 6 * c, 10 + 6 * c)
                    expected |= set(sorted(chunk, key=want.get)[-2:])
            else:
                expected |= set(sorted(want, key=want.get)[-10:])
            assert set(kept[head].tolist()) == expected


def test_a_budget_below_the_unscored_tail_keeps_the_newest():
    model = tiny_llama(kv_heads=2)
    policy = LagKV(lag=6)
    cache = _prefilled(model, policy)
    kept = policy.keep(_view(cache, 0, budget=4 + 3))[0]
    assert all(head == [0, 1, 2, 3, 37, 38, 39] for head in kept.tolist())


@pytest.mark.slow
def test_decoding_with_a_small_lag_matches_the_oracle():
    model = tiny_llama(kv_heads=2)
    cache = run_and_check(model, "lagkv", TOKENS, budget=24, buffer=6, steps=30, lag=4)
    assert cache.evictions >= 4
    heads = [tuple(h) for layer in range(3) for h in cache.positions(layer)[0].tolist()]
    assert len(set(heads)) > 1  # per-head selection really differs between heads


@pytest.mark.slow
def test_batch_equals_alone_with_a_small_lag():
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    prompts = ["A somewhat longer first prompt, to be padded against the others.", "Short.", "Middle one."]
    kw = dict(policy="lagkv", budget=14, buffer=4, max_new_tokens=16, lag=3)
    together = reasonkv.generate(model, tokenizer, prompts, **kw)
    for prompt, result in zip(prompts, together, strict=True):
        [alone] = reasonkv.generate(model, tokenizer, prompt, **kw)
        assert result.token_ids == alone.token_ids


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lag": 1}, "lag must be an integer >= 2"),
        ({"lag": 4.0}, "lagkv: option lag=4.0: expected int"),
        ({"value_weight": -1}, "value_weight must be a non-negative number"),
        ({"value_weight": float("nan")}, "value_weight must be a non-negative number, got nan"),
        ({"quota": "yes"}, "lagkv: option quota='yes': expected bool"),
        ({"sinks": -2}, "sinks must be a non-negative integer"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        reasonkv.get_policy("lagkv", **options)


def test_defaults_and_description():
    policy = reasonkv.get_policy("lagkv")
    assert (policy.lag, policy.value_weight, policy.quota, policy.sinks, policy.window) == (128, 1.0, True, 4, 0)
    assert LagKV.granularity == "head" and "2504.04704" in LagKV.paper
    needs = policy.needs(None)
    assert not needs.taps_attention and not needs.hidden_layers  # keys and values only
