"""Evicting-cache logits equal full-cache logits with the evicted positions masked (every step)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import TINY_MODELS
from oracle import run_and_check
from reasonkv.policies import Policy, select

PROMPT = [5 + (7 * i) % 80 for i in range(23)]


@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
@pytest.mark.parametrize("policy", ["streaming", "random"])
def test_oracle_core_policies(model_name, policy):
    model = TINY_MODELS[model_name]()
    cache = run_and_check(model, policy, PROMPT, budget=12, buffer=5, steps=30)
    assert cache.evictions >= 5  # eviction really happened, several times


def test_oracle_prompt_longer_than_budget_is_evicted_once_after_prefill(llama):
    prompt = [3 + i % 90 for i in range(40)]
    cache = run_and_check(llama, "streaming", prompt, budget=10, buffer=4, steps=3)
    assert cache.evictions == 1 and cache.slots == 10 + 3


def test_positions_stay_logical_after_eviction(llama):
    """Fails if eviction renumbers positions: kept slots carry their original logical positions."""
    cache = run_and_check(llama, "streaming", PROMPT, budget=12, buffer=5, steps=20, sinks=4)
    positions = cache.positions(1)[0, 0]
    newest = len(PROMPT) + 20 - 1
    held = sorted(positions.tolist())
    # sinks 0..3, then the most recent tokens up to the newest logical position
    assert held[:4] == [0, 1, 2, 3]
    assert held[-1] == newest
    assert held[4:] == list(range(newest - len(held) + 5, newest + 1))


def test_renumbered_positions_would_break_the_oracle(llama, monkeypatch):
    """The oracle is sensitive: renumbering positions to slot indices makes it fail."""
    from reasonkv.cache import EvictingCache

    original = EvictingCache.begin_forward

    def renumbered(self, *args):
        positions, step_positions, mask = original(self, *args)
        return (torch.full_like(positions, self.slots) if self.slots else positions), step_positions, mask

    monkeypatch.setattr(EvictingCache, "begin_forward", renumbered)
    with pytest.raises(AssertionError):
        run_and_check(llama, "streaming", PROMPT, budget=12, buffer=5, steps=10)


@dataclass
class _PerHeadRandom(Policy):
    """Test-only: a different random kept set in every (layer, kv-head)."""

    name = "test-per-head-random"
    granularity = "head"
    summary = "test"

    def keep(self, view):
        weights = torch.ones(view.valid.shape[0], view.info.num_kv_heads, view.valid.shape[1])
        return select.keep_sampled(
            weights,
            valid=view.valid_mask(),
            protected=view.protected(),
            k=view.budget,
            seeds=view.seeds,
            positions=view.positions(),
        )


@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
def test_oracle_with_per_head_kept_sets(model_name):
    model = TINY_MODELS[model_name]()
    cache = run_and_check(model, _PerHeadRandom(), PROMPT, budget=12, buffer=5, steps=30)
    positions = cache.positions(0)[0]
    if positions.shape[0] > 1:
        assert not all(torch.equal(positions[0], head) for head in positions[1:])  # heads really differ
    assert not torch.equal(cache.positions(0), cache.positions(1))  # and layers too
