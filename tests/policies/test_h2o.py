"""H2O: accumulated attention equals column sums of independently computed attention rows."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

import reasonkv
from attention_reference import drive, eager_attentions, masked_attentions
from conftest import TINY_MODELS, tiny_llama
from reasonkv.hf import cache_keyword

PROMPT = [5 + (13 * i) % 83 for i in range(12)]
TOKENS = [7 + (29 * i) % 80 for i in range(30)]


# ---------------------------------------------------------------------------------------- helpers
_drive = partial(drive, policy="h2o")


def _group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[Hq, ...] -> [Hkv, ...]``: query head ``h`` reads kv head ``h // (Hq // Hkv)``."""
    return x.reshape(kv_heads, x.shape[0] // kv_heads, *x.shape[1:]).mean(1)


def _table(cache, total):
    """The policy's accumulated scores of row 0, ``[layers, kv_heads, total]``."""
    return cache.evictor.policy.accumulated.data[0, :, :, :total].double()


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("model_name", ["llama-gqa", "llama-mqa", "qwen3-gqa"])
def test_scores_equal_column_sums_of_eager_attention(model_name):
    """No eviction: after prefill + 20 steps, every score is the column sum of the eager rows."""
    model = TINY_MODELS[model_name]()
    tokens = TOKENS[:20]
    cache, _, _ = _drive(model, PROMPT, tokens, budget=500, buffer=8)
    assert cache.evictions == 0
    ids = PROMPT + tokens
    kv_heads = model.config.num_key_value_heads
    want = torch.stack([_group_mean(a.sum(1), kv_heads) for a in eager_attentions(model, ids)])
    got = _table(cache, len(ids))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # A token's score is the mass of every query since it arrived: token 0 collects the most rows.
    assert (want[..., 0] > 1.0).all()


def test_prefill_scores_are_the_prompt_column_sums():
    model = tiny_llama()
    cache, _, _ = _drive(model, PROMPT, [], budget=500, buffer=8)
    want = torch.stack([_group_mean(a.sum(1), 2) for a in eager_attentions(model, PROMPT)])
    torch.testing.assert_close(_table(cache, len(PROMPT)), want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_scores_with_eviction_equal_masked_column_sums_and_kept_sets_follow_them():
    """With eviction every score equals the column sum of the rows over what the cache held, and
    at each eviction the dropped tokens are the lowest-scoring unprotected ones."""
    model, budget, buffer = tiny_llama(), 16, 4
    cache, held, _ = _drive(model, PROMPT, TOKENS, budget=budget, buffer=buffer)
    assert cache.evictions >= 5
    ids = PROMPT + TOKENS
    probs = masked_attentions(model, ids, len(PROMPT), held)
    want = torch.stack([_group_mean(p.sum(1), 2) for p in probs])  # evicted tokens stop collecting
    torch.testing.assert_close(_table(cache, len(ids)), want, atol=2e-5, rtol=1e-5)

    recent = budget // 2  # recent_ratio = 0.5
    sinks = 4
    evictions = 0
    for step in range(len(held) - 1):
        t = len(PROMPT) + step  # this step's token; the eviction (if any) follows its forward
        for layer in range(len(probs)):
            before = set(held[step][layer][0].tolist()) | {t}
            after_heads = held[step + 1][layer]
            if len(set(after_heads[0].tolist())) == len(before):
                continue  # no eviction after this step
            evictions += layer == 0
            scores = _group_mean(probs[layer][:, : t + 1].sum(1), 2)  # accumulated up to step t
            for head in range(after_heads.shape[0]):
                kept = set(after_heads[head].tolist())
                before_h = set(held[step][layer][head].tolist()) | {t}
                assert len(kept) == budget
                protected = {p for p in before_h if p < sinks or p > t - recent}
                assert protected <= kept
                dropped = before_h - kept
                heavy = kept - protected
                assert dropped and heavy
                assert max(scores[head, p] for p in dropped) <= min(scores[head, p] for p in heavy) + 1e-6
    assert evictions >= 4


@pytest.mark.slow
def test_batch_rows_accumulate_as_if_alone():
    """Left padding never leaks into scores: a padded row's scores equal its scores alone."""
    model = tiny_llama()
    short, long = PROMPT[:7], PROMPT
    alone, _, _ = _drive(model, short, TOKENS[:6], budget=500, buffer=8)
    cache = reasonkv.EvictingCache(500, 8, model=model, policy="h2o")
    key = cache_keyword(model)
    ids = torch.tensor([long, [0] * (len(long) - len(short)) + short])
    mask = torch.tensor([[1] * len(long), [0] * (len(long) - len(short)) + [1] * len(short)])
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})
        for token in TOKENS[:6]:
            model(input_ids=torch.tensor([[token], [token]]), use_cache=True, **{key: cache})
    cache.detach()
    total = len(short) + 6
    got = cache.evictor.policy.accumulated.data[1, :, :, :total]
    torch.testing.assert_close(got, alone.evictor.policy.accumulated.data[0, :, :, :total], atol=2e-6, rtol=1e-5)


def test_recent_part_follows_the_budget_and_window():
    policy = reasonkv.get_policy("h2o")
    assert policy.recent_ratio == 0.5 and policy.recent(16) == 8 and policy.recent(1000) == 500
    assert reasonkv.get_policy("h2o", window=12).recent(16) == 12
    assert reasonkv.get_policy("h2o", recent_ratio=0.0).recent(16) == 0
    needs = policy.needs(None)
    assert needs.attention_sum and not needs.attention_last and needs.query_window == 0


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, float("nan")])
def test_recent_ratio_out_of_range_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"h2o: recent_ratio must be a number in \[0, 1\), got {bad!r}$"):
        reasonkv.get_policy("h2o", recent_ratio=bad)


@pytest.mark.parametrize("bad", ["half", "0.5", True, None])
def test_recent_ratio_of_another_type_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"h2o: option recent_ratio={re.escape(repr(bad))}: expected float$"):
        reasonkv.get_policy("h2o", recent_ratio=bad)


def test_recent_window_larger_than_budget_is_a_clear_error():
    model = tiny_llama()
    with pytest.raises(ValueError, match="protected tokens exceed the budget"):
        _drive(model, PROMPT, TOKENS[:10], budget=6, buffer=2, recent_ratio=0.9)


@pytest.mark.slow
def test_chunked_forward_equals_single_steps():
    """``chunk_exact``: feeding tokens in one forward leaves the same scores as one at a time."""
    model = tiny_llama()
    tokens = TOKENS[:10]
    single, *_ = _drive(model, PROMPT, tokens, budget=500, buffer=8)
    chunked = reasonkv.EvictingCache(500, 8, model=model, policy="h2o")
    key = cache_keyword(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: chunked})
        model(input_ids=torch.tensor([tokens]), use_cache=True, **{key: chunked})
    chunked.detach()
    total = len(PROMPT) + len(tokens)
    assert chunked.evictor.policy.chunk_exact
    torch.testing.assert_close(
        chunked.evictor.policy.accumulated.data[..., :total],
        single.evictor.policy.accumulated.data[..., :total],
        atol=1e-6,
        rtol=1e-5,
    )
