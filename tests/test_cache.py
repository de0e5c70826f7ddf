"""EvictingCache storage: budget invariants, padding, compaction, errors, transformers API."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import TINY_MODELS, fast_few
from reasonkv.cache import EvictingCache
from reasonkv.hf import cache_keyword


def _decode(model, cache, prompt_ids, steps, mask=None):
    key = cache_keyword(model)
    ids = torch.tensor(prompt_ids)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})
    history = [cache.slots]
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(input_ids=token, use_cache=True, **{key: cache})
        history.append(cache.slots)
    return history


@pytest.mark.parametrize("model_name", fast_few(sorted(TINY_MODELS), fast=("llama-gqa", "qwen3-gqa")))
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.bfloat16, marks=pytest.mark.slow),
        pytest.param(torch.float16, marks=pytest.mark.slow),
    ],
)
def test_budget_never_exceeded_and_exactly_k_after_each_eviction(model_name, dtype):
    model = TINY_MODELS[model_name](dtype=dtype)
    budget, buffer = 10, 6
    cache = EvictingCache(budget, buffer, model=model, policy="streaming")
    evictions = []
    original = cache.compact

    def spy(rows, keep, quantized=None):
        original(rows, keep, quantized)
        evictions.append(cache.row_lengths().tolist())

    cache.compact = spy
    history = _decode(model, cache, [[3 + i for i in range(8)]], steps=40)
    assert max(history) <= budget + buffer
    assert evictions and all(lengths == [budget] for lengths in evictions)
    assert cache.peak_slots == budget + buffer - 1 or cache.peak_slots == budget + buffer
    layer = cache.layers[0]
    assert layer.keys.dtype == dtype and layer.keys.shape[2] == cache.slots
    assert (
        cache.kv_bytes()
        <= (budget + buffer)
        * 2
        * model.config.num_hidden_layers
        * layer.keys.shape[1]
        * layer.keys.shape[3]
        * layer.keys.element_size()
    )


def test_padding_never_occupies_budget_and_rows_evict_on_their_own_schedule(llama):
    budget, buffer = 8, 4
    cache = EvictingCache(budget, buffer, model=llama, policy="streaming")
    prompts = [[5] * 10, [6] * 3]
    width = 10
    ids = torch.tensor([p + [0] * 0 for p in [prompts[0], [0] * 7 + prompts[1]]])
    mask = torch.tensor([[1] * 10, [0] * 7 + [1] * 3])
    _decode(llama, cache, ids.tolist(), steps=0, mask=mask)
    assert cache.row_lengths().tolist() == [10, 3] and cache.slots == width
    key = cache_keyword(llama)
    for _ in range(2):
        llama(input_ids=torch.tensor([[7], [7]]), use_cache=True, **{key: cache})
    # row 0 reached 12 = K + B and was shrunk to 8; row 1 holds its 5 real tokens, left-padded
    assert cache.row_lengths().tolist() == [8, 5]
    assert cache.slots == 8
    assert cache.valid[1].tolist() == [False] * 3 + [True] * 5
    assert cache.positions(0)[1, 0].tolist() == [-1, -1, -1, 0, 1, 2, 3, 4]
    assert cache.row_evictions.tolist() == [1, 0]


def test_bad_sizes_are_clear_errors(llama):
    with pytest.raises(ValueError, match="budget must be a positive integer.*got 0"):
        EvictingCache(0, 4)
    with pytest.raises(ValueError, match="budget must be a positive integer.*got -3"):
        EvictingCache(-3, 4)
    with pytest.raises(ValueError, match="buffer must be a non-negative integer, got -1"):
        EvictingCache(8, -1)
    with pytest.raises(ValueError, match=r"sinks \(4\) \+ window \(10\) = 14 protected tokens exceed the budget 8"):
        EvictingCache(8, 4, model=llama, policy="streaming", window=10)
    with pytest.raises(ValueError, match="unknown policy 'nope'; valid policies: .*streaming"):
        EvictingCache(8, 4, model=llama, policy="nope")
    with pytest.raises(ValueError, match="policy 'streaming' has no option 'windw'"):
        EvictingCache(8, 4, model=llama, policy="streaming", windw=3)
    with pytest.raises(ValueError, match="needs the model"):
        EvictingCache(8, 4, policy="streaming")


def test_protect_prompt_longer_than_budget_is_a_clear_error(llama):
    cache = EvictingCache(8, 2, model=llama, policy="streaming", protect_prompt=True)
    with pytest.raises(ValueError, match="protect_prompt keeps a prompt of 12 tokens, more than the budget 8"):
        _decode(llama, cache, [[3] * 12], steps=0)


def test_protect_prompt_keeps_every_prompt_token(llama):
    cache = EvictingCache(12, 3, model=llama, policy="streaming", protect_prompt=True, sinks=0)
    _decode(llama, cache, [[3 + i for i in range(9)]], steps=20)
    held = set(cache.positions(0)[0, 0].tolist())
    assert set(range(9)) <= held and cache.evictions > 0


def test_models_without_full_attention_are_refused():
    from conftest import tiny_mistral

    with pytest.raises(ValueError, match=r"no full-attention layer \(sliding: layers \[0, 1\]\): there is nothing"):
        EvictingCache(8, 4, model=tiny_mistral(), policy="streaming")


def test_hooks_are_removed_on_detach_and_when_the_cache_is_dropped(llama):
    import gc

    before = (len(llama._forward_pre_hooks), len(llama._forward_hooks))
    cache = EvictingCache(8, 4, model=llama, policy="streaming")
    assert len(llama._forward_pre_hooks) == before[0] + 1
    cache.detach()
    assert (len(llama._forward_pre_hooks), len(llama._forward_hooks)) == before
    cache = EvictingCache(8, 4, model=llama, policy="streaming")
    del cache
    gc.collect()
    assert (len(llama._forward_pre_hooks), len(llama._forward_hooks)) == before


def test_unsupported_cache_operations_say_so(llama):
    cache = EvictingCache(8, 4, model=llama, policy="streaming")
    _decode(llama, cache, [[3, 4, 5]], steps=1)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="cropped"):
        cache.crop(1)


def test_public_api_exports():
    assert {"full", "streaming", "random"} <= set(reasonkv.list_policies())
    assert reasonkv.get_policy("streaming", sinks=2).sinks == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_slots_equals_an_elementwise_gather(dtype):
    """The eviction gather picks whole head_dim rows; it must equal torch.gather, per (row, head) indices."""
    from reasonkv.cache.layer import take_slots

    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(3, 2, 10, 4, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(10, generator=generator)[:6] for _ in range(6)]).view(3, 2, 6)
    expected = buffer.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 4))
    assert torch.equal(take_slots(buffer, index), expected)
