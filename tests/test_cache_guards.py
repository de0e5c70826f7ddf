"""A cache whose budget would silently stop holding is refused; one cache is one generation; the
buffers are sized to what the run can need."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import CharTokenizer, tiny_llama, tiny_qwen3
from reasonkv.cache import EvictingCache
from reasonkv.cache.rows import GROWTH
from reasonkv.hf import cache_keyword

PROMPT = torch.tensor([[3 + (7 * i) % 80 for i in range(20)]])
NOT_EVICTING = "used by a forward pass it cannot evict in"


def _generate(model, cache, new_tokens=37):
    with torch.inference_mode():
        return model.generate(
            PROMPT,
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            **{cache_keyword(model): cache},
        )


def test_a_cache_built_without_the_model_refuses_to_run_unevicted():
    model = tiny_llama()
    with pytest.raises(RuntimeError, match=NOT_EVICTING):
        _generate(model, EvictingCache(16, 8))


def test_a_cache_built_for_another_model_refuses_to_run_unevicted():
    model, other = tiny_llama(), tiny_llama(seed=1)
    with (
        EvictingCache(16, 8, model=other, policy="streaming") as cache,
        pytest.raises(RuntimeError, match=NOT_EVICTING),
    ):
        _generate(model, cache)


def test_a_detached_cache_refuses_to_run_unevicted():
    model = tiny_llama()
    with EvictingCache(16, 8, model=model, policy="streaming") as cache:
        pass
    with pytest.raises(RuntimeError, match=NOT_EVICTING):
        _generate(model, cache)


def test_a_full_cache_without_a_model_is_plain_storage():
    model = tiny_llama()
    cache = EvictingCache(None)
    out = _generate(model, cache, new_tokens=5)
    assert cache.slots == PROMPT.shape[1] + 4 and out.shape[1] == PROMPT.shape[1] + 5


def test_a_second_generate_on_a_filled_cache_is_refused_and_reset_makes_it_fresh():
    model = tiny_qwen3()
    with EvictingCache(16, 8, model=model, policy="h2o") as fresh:
        want = _generate(model, fresh)
    with EvictingCache(16, 8, model=model, policy="h2o") as cache:
        first = _generate(model, cache)
        assert cache.evictions > 0
        with pytest.raises(ValueError, match=r"already holds a generation.*cache.reset\(\)"):
            _generate(model, cache)
        cache.reset()
        again = _generate(model, cache)
    assert torch.equal(first, want) and torch.equal(again, want)


def test_buffers_are_reserved_once_for_what_generate_can_need():
    """reasonkv.generate reserves prompt + new tokens (full) or K + B (evicting) once: no growth, no spare."""
    model, tokenizer = tiny_llama(), CharTokenizer()
    seen = {}

    def on_step(step, cache):
        seen.setdefault("capacities", set()).add(cache.capacity)
        seen["slots"] = max(seen.get("slots", 0), cache.slots)

    prompts = ["a prompt of some length", "short"]
    reasonkv.generate(model, tokenizer, prompts, max_new_tokens=40, ignore_eos=True, on_step=on_step)
    assert seen["capacities"] == {len(prompts[0]) + 40}  # exactly what the run can reach, allocated once
    seen.clear()
    reasonkv.generate(
        model, tokenizer, prompts, policy="streaming", budget=12, buffer=6, max_new_tokens=40, on_step=on_step
    )
    # The long prompt is evicted alone (a ragged batch), so the layers keep up to B slots more than K + B:
    # its prompt's 23, allocated once.
    assert seen["capacities"] == {23} and seen["slots"] <= 18


def test_without_a_known_length_the_buffers_grow_by_a_small_factor():
    """model.generate does not say how long the run is: the spare room stays within GROWTH."""
    model = tiny_llama()
    cache = EvictingCache(None)
    key = cache_keyword(model)
    capacities = []
    with torch.inference_mode():
        out = model(input_ids=PROMPT, **{key: cache})
        for _ in range(120):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
            capacities.append((cache.capacity, cache.slots))
    assert all(capacity <= max(slots, GROWTH * (slots - 1) + 1) for capacity, slots in capacities)
    assert len({c for c, _ in capacities}) > 3  # it did grow, several times
