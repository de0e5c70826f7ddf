"""TOVA: scores equal the newest query's attention row, averaged over the layer's heads."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

import reasonkv
from attention_reference import drive, eager_attentions, masked_attentions
from conftest import TINY_MODELS, fast_few, tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies.view import EvictionView

PROMPT = [4 + (17 * i) % 85 for i in range(12)]
TOKENS = [9 + (31 * i) % 80 for i in range(30)]


# ---------------------------------------------------------------------------------------- helpers
def _scores_by_position(cache) -> torch.Tensor:
    """What TOVA would score row 0's held tokens now, by logical position: ``[layers, kv_heads, positions]``
    (0 where nothing is held)."""
    evictor = cache.evictor
    view = EvictionView(
        cache=cache,
        recorded=evictor.observer.recorded,
        policy=evictor.policy,
        rows=torch.tensor([0]),
        row_seeds=evictor.row_seeds[:1],
        info=evictor.info,
    )
    layers = []
    for layer in range(len(cache.layers)):
        positions = cache.positions(layer)[0]  # [kv_heads, slots]
        score = evictor.policy.score(view.at(layer))[0]
        table = torch.zeros(positions.shape[0], cache.seen + 1)
        layers.append(table.scatter(1, positions.clamp(min=0), torch.where(positions >= 0, score, 0.0)))
    return torch.stack(layers)


_drive = partial(drive, policy="tova", snapshot=_scores_by_position)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("model_name", fast_few(["llama-gqa", "llama-mha", "qwen3-gqa"], fast=("qwen3-gqa",)))
def test_scores_equal_eager_newest_row_averaged_over_heads(model_name):
    """No eviction: after every forward the table holds that forward's newest eager row, mean over heads,
    the same for every kv head of the layer."""
    model = TINY_MODELS[model_name]()
    tokens = TOKENS[:20]
    cache, _, tables = _drive(model, PROMPT, tokens, budget=500, buffer=8)
    assert cache.evictions == 0
    ids = PROMPT + tokens
    eager = eager_attentions(model, ids)
    kv_heads = model.config.num_key_value_heads
    for forward, table in enumerate(tables):
        t = len(PROMPT) - 1 + forward  # the newest query of this forward
        want = torch.stack([a[:, t, : t + 1].mean(0) for a in eager])  # [layers, t + 1]
        got = table[..., : t + 1].double()  # [layers, kv_heads, t + 1]
        torch.testing.assert_close(got, want.unsqueeze(1).expand(-1, kv_heads, -1), atol=2e-6, rtol=1e-5)


@pytest.mark.slow
def test_per_kv_group_option_averages_each_group():
    model = tiny_llama()  # 4 query heads, 2 kv heads
    tokens = TOKENS[:10]
    _, _, tables = _drive(model, PROMPT, tokens, budget=500, buffer=8, layerwise=False)
    ids = PROMPT + tokens
    t = len(ids) - 1
    want = torch.stack([a[:, t].reshape(2, 2, -1).mean(1) for a in eager_attentions(model, ids)])
    torch.testing.assert_close(tables[-1][..., : t + 1].double(), want, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(want[:, 0], want[:, 1])  # the groups really differ


@pytest.mark.slow
def test_buffer_zero_is_tova_one_token_per_step():
    """buffer=0: each step drops exactly one token, the one the newest query (over what the cache
    held) attends to least, averaged over all heads; every kv head of a layer keeps the same set."""
    model, budget = tiny_llama(), 14
    cache, held, _ = _drive(model, PROMPT, TOKENS, budget=budget, buffer=0, sinks=2)
    ids = PROMPT + TOKENS
    probs = masked_attentions(model, ids, len(PROMPT), held)
    checked = 0
    for step in range(len(held) - 1):
        t = len(PROMPT) + step
        for layer, p in enumerate(probs):
            heads = held[step + 1][layer]
            assert all(torch.equal(heads[0], h) for h in heads)  # one set per layer
            before = set(held[step][layer][0].tolist()) | {t}
            kept = set(heads[0].tolist())
            if len(before) <= budget:
                continue
            dropped = before - kept
            assert len(dropped) == 1 and len(kept) == budget
            (gone,) = dropped
            score = p[:, t].mean(0)  # the newest row over the held tokens, mean over all heads
            candidates = [q for q in before if q >= 2]  # sinks are protected
            assert score[gone] == min(score[q] for q in candidates)
            checked += 1
    assert checked >= 3 * 20


@pytest.mark.slow
def test_scores_with_eviction_equal_masked_newest_rows():
    """With eviction, the score of each held position equals the newest masked row (mean over heads).
    (Checked after the forwards that did not evict: after an eviction the cache holds less.)"""
    model = tiny_llama()
    cache, held, tables = _drive(model, PROMPT, TOKENS, budget=16, buffer=4)
    assert cache.evictions >= 5
    ids = PROMPT + TOKENS
    probs = masked_attentions(model, ids, len(PROMPT), held)
    checked = 0
    for step in range(len(held) - 1):
        t = len(PROMPT) + step
        table = tables[step + 1]
        for layer, p in enumerate(probs):
            positions = held[step][layer][0].tolist() + [t]
            if sorted(held[step + 1][layer][0].tolist()) != sorted(positions):
                continue  # this forward evicted
            want = p[:, t, positions].mean(0)
            torch.testing.assert_close(table[layer, 0, positions].double(), want, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(table[layer, 1, positions], table[layer, 0, positions])
            checked += 1
    assert checked >= 3 * 15


def test_needs_only_the_newest_query():
    needs = reasonkv.get_policy("tova").needs(None)
    assert needs.query_window == 1 and not needs.attention_last and not needs.attention_sum


@pytest.mark.parametrize("bad", [1, "yes", "False", None])
def test_bad_layerwise_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"tova: option layerwise={re.escape(repr(bad))}: expected bool$"):
        reasonkv.get_policy("tova", layerwise=bad)


@pytest.mark.slow
def test_chunked_forward_equals_single_steps():
    """``chunk_exact``: feeding tokens in one forward leaves the same scores as one at a time."""
    model = tiny_llama()
    tokens = TOKENS[:10]
    single, *_ = _drive(model, PROMPT, tokens, budget=500, buffer=8, snapshot=None)
    chunked = reasonkv.EvictingCache(500, 8, model=model, policy="tova")
    key = cache_keyword(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: chunked})
        model(input_ids=torch.tensor([tokens]), use_cache=True, **{key: chunked})
    chunked.detach()
    total = len(PROMPT) + len(tokens)
    assert chunked.evictor.policy.chunk_exact
    torch.testing.assert_close(
        _scores_by_position(chunked)[..., :total], _scores_by_position(single)[..., :total], atol=1e-6, rtol=1e-5
    )
