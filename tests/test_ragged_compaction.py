"""A ragged batch: rows evict on their own schedules, and an eviction rewrites only the rows it evicts."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.cache.layer import EvictingLayer
from reasonkv.cache.quantized_tier import QuantizedTier
from reasonkv.hf import cache_keyword

BATCH, LAYERS, BUDGET, BUFFER, STEPS = 8, 4, 24, 16, 64
# Eight prompt lengths that put every row at a different point of its K + B cycle.
LENGTHS = [BUDGET + 2 * i for i in range(BATCH)]


class _Touched:
    """Counts the rows each kind of rewrite touches, summed over layers."""

    def __init__(self, monkeypatch):
        self.evicted = self.moved = self.tier = 0
        compact, front, resize = EvictingLayer.compact_rows, EvictingLayer._to_front, EvictingLayer.resize
        apply, reshaped = QuantizedTier.apply, QuantizedTier._reshaped

        def compact_rows(layer, rows, keep, length):
            self.evicted += rows.numel()
            return compact(layer, rows, keep, length)

        def to_front(layer):
            self.moved += layer._keys.shape[0]
            return front(layer)

        def resized(layer, capacity):
            self.moved += layer._keys.shape[0]
            return resize(layer, capacity)

        def tier_apply(tier, update, groups):
            self.tier += update.rows.numel()
            return apply(tier, update, groups)

        def tier_reshaped(tier, *args):
            self.tier += tier.positions.shape[0]
            return reshaped(tier, *args)

        monkeypatch.setattr(EvictingLayer, "compact_rows", compact_rows)
        monkeypatch.setattr(EvictingLayer, "_to_front", to_front)
        monkeypatch.setattr(EvictingLayer, "resize", resized)
        monkeypatch.setattr(QuantizedTier, "apply", tier_apply)
        monkeypatch.setattr(QuantizedTier, "_reshaped", tier_reshaped)


@torch.inference_mode()
def _decode(model, cache, touched: _Touched) -> tuple[int, int, int]:
    """Prefill the ragged prompts, then decode; returns (eviction events, rows evicted, rows touched at prefill)."""
    width = max(LENGTHS)
    ids = torch.tensor([[0] * (width - n) + [5 + (7 * i + n) % 80 for i in range(n)] for n in LENGTHS])
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in LENGTHS])
    key = cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    at_prefill = touched.evicted + touched.moved + touched.tier
    events = 0
    for _ in range(STEPS):
        before = cache.evictor.eviction_count
        out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
        events += cache.evictor.eviction_count - before
    return events, cache.evictions, at_prefill


@pytest.mark.parametrize("tier", [{}, dict(quantized=32, bits=4, group_size=8)], ids=["plain", "tiered"])
def test_a_ragged_batch_rewrites_the_rows_it_evicts_and_moves_the_others_once_per_b_steps(
    tier, monkeypatch, one_torch_thread
):
    model = tiny_llama(layers=LAYERS)
    touched = _Touched(monkeypatch)
    cache = reasonkv.EvictingCache(BUDGET, BUFFER, model=model, policy="streaming", **tier)
    events, evicted_rows, at_prefill = _decode(model, cache, touched)
    cache.detach()
    # Rows evict on their own schedules: many more eviction events than the 4 of a lockstep batch...
    assert events >= 3 * STEPS // BUFFER, events
    # ...and each rewrites only its own rows: every layer's rows evicted once each (prefill evictions
    # included), plus all rows moved once every B steps at most.
    assert touched.evicted == LAYERS * evicted_rows  # no row was fed padding, so none is right-aligned again
    assert touched.moved <= LAYERS * BATCH * (STEPS // BUFFER + 1), touched.moved
    if tier:
        # the tier's rows: the evicted ones, plus all rows while its width grows (it fills after a few evictions)
        assert touched.tier <= LAYERS * (evicted_rows + 4 * BATCH), touched.tier
    # What rewriting every row at every eviction would have touched, for comparison:
    assert touched.evicted + touched.moved < LAYERS * BATCH * events / 2
    assert at_prefill <= LAYERS * 2 * BATCH
