"""Ragged storage: each head holds only what it keeps, reads exactly like dense storage, and the bytes it
allocates (measured from its tensors) are the budgets plus B per head."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.cache import CacheSpec
from reasonkv.cache.layer import EvictingLayer
from reasonkv.cache.ragged import RaggedLayer
from reasonkv.cache.rows import RowState
from reasonkv.hf import cache_keyword

PROMPT = [5 + (7 * i) % 80 for i in range(60)]


def _unannounced(*args):
    raise AssertionError("the layers are written directly")


def _same(ragged: RaggedLayer, dense: EvictingLayer) -> None:
    """Both layers hold the same tokens at the same dense slots (a head's padding: position -1, no K/V read)."""
    positions = dense.positions
    assert torch.equal(ragged.positions, positions)
    held = (positions >= 0).unsqueeze(-1)
    for got, want in ((ragged.keys, dense.keys), (ragged.values, dense.values)):
        assert got.shape == want.shape
        assert torch.equal(got * held, want * held)


@pytest.mark.parametrize("seed", range(6))
def test_ragged_layer_reads_and_compacts_exactly_like_a_dense_one(seed):
    """Random writes (padding included) and evictions that keep a different number per head and row: the
    ragged layer's dense reads equal a dense layer's after every operation."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, dim, every = 3, 4, 8, 5
    rows = RowState(None)
    dense, ragged = EvictingLayer(rows, _unannounced), RaggedLayer(rows, _unannounced, every=every)
    position = torch.zeros(batch, dtype=torch.long)
    evictions = 0
    for step in range(40):
        q = int(torch.randint(1, 6, (1,), generator=generator)) if step % 7 == 0 else 1
        keys = torch.randn(batch, heads, q, dim, generator=generator)
        values = torch.randn(batch, heads, q, dim, generator=generator)
        real = torch.rand(batch, q, generator=generator) > 0.15  # some padding, in the middle too
        positions = (position.view(-1, 1) + real.long().cumsum(1) - 1).masked_fill(~real, -1)
        position += real.sum(1)
        for layer in (dense, ragged):
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.write(keys, values, positions) if layer is ragged else _dense_write(layer, keys, values, positions)
        _same(ragged, dense)
        if step % 6 == 5:  # evict some rows: each head keeps its own number of slots (holes first)
            evicted = torch.tensor([r for r in range(batch) if torch.rand(1, generator=generator) > 0.3] or [0])
            slots = dense.length
            width = int(torch.randint(1, slots + 1, (1,), generator=generator))
            kept = torch.stack(
                [torch.stack([_choose(slots, width, generator) for _ in range(heads)]) for _ in range(evicted.numel())]
            )
            holes = kept < 0
            length = max(width, _longest_other(dense, evicted))
            for layer in (dense, ragged):
                layer.compact_rows(evicted, kept.clamp(min=0), length, holes=holes)
            evictions += 1
            _same(ragged, dense)
    assert evictions >= 5
    # The ragged layer holds each head's tokens plus its room, never the dense axis x heads.
    assert ragged.entries <= int((ragged.count + every).sum(-1).max()) + 6 * 40


def _dense_write(layer: EvictingLayer, keys, values, positions) -> None:
    layer.write(keys, values, positions)


def _choose(slots: int, width: int, generator) -> torch.Tensor:
    """``width`` entries: some slots ascending, the rest -1 first (a head keeping fewer)."""
    n = int(torch.randint(0, width + 1, (1,), generator=generator))
    chosen = torch.randperm(slots, generator=generator)[:n].sort().values
    return torch.cat([torch.full((width - n,), -1, dtype=torch.long), chosen])


def _longest_other(layer: EvictingLayer, evicted: torch.Tensor) -> int:
    """The dense axis must still hold the rows not evicted: their first slot holding a token, from the end."""
    held = (layer.positions >= 0).any(1)  # [batch, slots]
    longest = 0
    for row in range(held.shape[0]):
        if row in evicted.tolist() or not bool(held[row].any()):
            continue
        first = int(held[row].to(torch.int8).argmax())
        longest = max(longest, held.shape[1] - first)
    return longest


@pytest.mark.parametrize("allocation", [pytest.param("pyramid", marks=pytest.mark.slow), "adaptive"])
def test_ragged_storage_decodes_exactly_like_padded_dense_storage(allocation):
    model = tiny_llama(layers=4)
    prompts = [PROMPT, PROMPT[7:40]]
    runs = []
    for ragged in (True, False):
        spec = CacheSpec.build("snapkv", 16, 6, window=3, seed=[4, 5], allocation=allocation, ragged=ragged)
        runs.append(reasonkv.generate(model, None, prompts, spec=spec, max_new_tokens=50, chat=False, ignore_eos=True))
    for ragged, dense in zip(*runs, strict=True):
        assert ragged.token_ids == dense.token_ids
        assert ragged.stats["evictions"] == dense.stats["evictions"] > 5


@pytest.mark.parametrize("allocation", ["uniform", "pyramid", pytest.param("adaptive", marks=pytest.mark.slow)])
def test_bytes_held_are_the_budgets_plus_b_per_head_measured(allocation):
    """After every eviction the K/V the cache allocates (its tensors' bytes) are K x layers x kv-heads + B per
    head, exactly as the uniform cache's: no head is padded to the widest."""
    model = tiny_llama(layers=4, kv_heads=2)
    budget, buffer, layers, heads, dim = 16, 6, 4, 2, 16
    expected = 2 * (budget * layers * heads + buffer * layers * heads) * dim * 4  # keys and values, float32
    spec = CacheSpec.build("snapkv", budget, buffer, window=3, allocation=allocation)
    key = cache_keyword(model)
    held_after, evictions = [], 0
    with reasonkv.EvictingCache(spec=spec, model=model) as cache:
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: cache})
        for _ in range(50):
            if cache.evictions > evictions:
                evictions = cache.evictions
                held_after.append(cache.kv_bytes())
            out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{key: cache})
    assert len(held_after) >= 6 and set(held_after) == {expected}
    if allocation != "uniform":
        padded = CacheSpec.build("snapkv", budget, buffer, window=3, allocation=allocation, ragged=False)
        assert all(isinstance(cache.layers[i], RaggedLayer) for i in cache.full_layers)
        with reasonkv.EvictingCache(spec=padded, model=model) as dense:
            out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: dense})
            for _ in range(20):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{key: dense})
        assert dense.kv_bytes() > expected  # padded to the widest head


def test_steady_bytes_count_each_heads_own_tokens():
    """What a run reports held after its evictions is K x layers x kv-heads tokens under every allocation
    (each head's own count, not the widest head's times the heads)."""
    model = tiny_llama(layers=4, kv_heads=2)
    per_token = 4 * 2 * 2 * 16 * 4  # layers x kv_heads x (K and V) x head_dim x fp32
    for allocation in ("uniform", "pyramid", "adaptive"):
        spec = CacheSpec.build("snapkv", 16, 6, window=3, allocation=allocation)
        [result] = reasonkv.generate(model, None, [PROMPT], spec=spec, max_new_tokens=30, chat=False, ignore_eos=True)
        steady = result.stats["steady_kv_bytes"]
        assert steady["full"] == 16 * per_token and steady["tokens"] == 16, (allocation, steady)
