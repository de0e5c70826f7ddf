"""SnapKV window scores against the eager attention weights of the same tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reasonkv
from attention_reference import eager_attentions
from conftest import TINY_MODELS, tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies.contract import ModelInfo, Needs
from reasonkv.policies.snapkv import pool_valid, window_scores

W = 32  # the default query window
PROMPTS = [[5 + (13 * i) % 80 for i in range(40)], [7 + (29 * i) % 80 for i in range(35)]]


def _eager_window_reference(model, prompt: list[int]) -> list[torch.Tensor]:
    """Per layer: eager softmax weights of the last W queries, summed over them, mean per kv group."""
    kv_heads = model.config.num_key_value_heads
    reference = []
    for attention in eager_attentions(model, prompt):  # [heads, T, T]
        summed = attention[:, -W:, :].sum(1).float()  # [heads, T]
        reference.append(summed.view(kv_heads, -1, summed.shape[-1]).mean(1))
    return reference


def _max_pool_reference(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    padded = F.pad(scores, (kernel // 2, kernel // 2), value=float("-inf"))
    return padded.unfold(-1, kernel, 1).amax(-1)


def _policy_scores(model, prompts: list[list[int]], budget: int, buffer: int) -> dict[int, dict]:
    """Prefill `prompts` (left-padded) with snapkv; capture what the policy scored at the first eviction."""
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    captured: dict[int, dict] = {}
    with reasonkv.EvictingCache(budget, buffer, model=model, policy="snapkv", window=4) as cache:
        policy = cache.evictor.policy
        original = policy.score

        def score(view):
            scores = original(view)
            if view.layer not in captured:
                captured[view.layer] = dict(
                    pooled=scores.clone(),
                    raw=window_scores(view, kernel=1),
                    positions=view.positions().clone(),
                    valid=view.valid.clone(),
                )
            return scores

        policy.score = score
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_keyword(model): cache})
    assert sorted(captured) == list(range(model.config.num_hidden_layers)), "no eviction after the prefill"
    return captured


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_window_scores_equal_eager_attention_weights(name):
    model = TINY_MODELS[name]()
    assert model.config._attn_implementation == "sdpa"  # the policy runs under SDPA
    captured = _policy_scores(model, PROMPTS[:1], budget=24, buffer=8)
    reference = _eager_window_reference(model, PROMPTS[0])
    for layer, want in enumerate(reference):
        got = captured[layer]
        assert torch.equal(got["positions"][0], torch.arange(40).expand_as(got["positions"][0]))
        torch.testing.assert_close(got["raw"][0], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["pooled"][0], _max_pool_reference(want, 7), atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_window_scores_of_a_padded_row_equal_its_eager_weights_alone():
    model = TINY_MODELS["llama-gqa"]()
    captured = _policy_scores(model, PROMPTS, budget=24, buffer=8)
    for row, prompt in enumerate(PROMPTS):
        reference = _eager_window_reference(model, prompt)
        for layer, want in enumerate(reference):
            got = captured[layer]
            real = got["valid"][row]
            assert int(real.sum()) == len(prompt)
            torch.testing.assert_close(got["raw"][row][:, real], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["pooled"][row][:, real], _max_pool_reference(want, 7), atol=1e-5, rtol=1e-5)
            assert torch.all(got["pooled"][row][:, ~real] == 0)


def test_pooling_sees_real_tokens_only():
    scores = torch.tensor([[[9.0, 9.0, 1.0, 2.0, 6.0, 1.0]]])
    valid = torch.tensor([[[False, False, True, True, True, True]]])
    alone = torch.tensor([[[1.0, 2.0, 6.0, 1.0]]])
    for mode in ("max", "avg"):
        padded = pool_valid(scores, valid, 3, mode)
        assert torch.all(padded[..., :2] == 0)
        torch.testing.assert_close(
            padded[..., 2:], pool_valid(alone, torch.ones_like(alone, dtype=torch.bool), 3, mode)
        )
    avg = pool_valid(alone, torch.ones_like(alone, dtype=torch.bool), 3, "avg")
    torch.testing.assert_close(avg, torch.tensor([[[1.5, 3.0, 3.0, 3.5]]]))


def test_snapkv_reads_only_recent_queries_and_protects_its_window():
    policy = reasonkv.get_policy("snapkv")
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    assert policy.needs(info) == Needs(query_window=32)
    assert (policy.window, policy.query_window, policy.kernel, policy.pooling) == (32, 32, 7, "max")
    assert policy.granularity == "head" and not policy.stochastic


def test_snapkv_keeps_the_top_pooled_scores():
    model = tiny_llama()
    checked = []
    with reasonkv.EvictingCache(24, 8, model=model, policy="snapkv", window=4) as cache:
        policy = cache.evictor.policy
        original = policy.keep

        def keep(view):
            kept = original(view)
            score = policy.score(view)[0].clone()
            score[view.protected()[0]] = float("inf")
            assert torch.equal(kept[0], score.topk(view.budget, dim=-1).indices.sort(-1).values)
            checked.append(view.layer)
            return kept

        policy.keep = keep
        with torch.no_grad():
            model(input_ids=torch.tensor(PROMPTS[:1]), use_cache=True, **{cache_keyword(model): cache})
    assert checked == [0, 1, 2]


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(kernel=4), "kernel must be a positive odd integer"),
        (dict(kernel=0), "kernel must be a positive odd integer"),
        (dict(pooling="mean"), "pooling must be one of max, avg"),
        (dict(query_window=0), "query_window must be a positive integer"),
    ],
)
def test_bad_window_options_are_clear_errors(options, match):
    for name in ("snapkv", "vase-attnv"):
        with pytest.raises(ValueError, match=f"{name}: {match}"):
            reasonkv.get_policy(name, **options)
