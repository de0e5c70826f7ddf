"""Attention owed at eviction equals attention paid at every step: the deferred, batched bookkeeping of
the attention readers keeps exactly the sets the per-step computation keeps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import reasonkv
from conftest import TINY_MODELS
from reasonkv.hf import cache_keyword
from reasonkv.policies import Policy
from reasonkv.policies.common import PositionTable
from reasonkv.policies.contract import Needs

PROMPTS = [[5 + (11 * i + r) % 80 for i in range(n)] for r, n in enumerate((19, 12, 15))]


@dataclass
class _TovaPerStep(Policy):
    """TOVA as a per-step table: each forward's newest row, overwritten at every step (the reference)."""

    name = "test-tova-per-step"
    granularity = "head"
    summary = "test"

    def needs(self, info):
        return Needs(attention_last=True)

    def reset(self, info, batch, device):
        self.kv_heads = info.num_kv_heads
        self.table = PositionTable(batch, (info.num_layers, info.num_kv_heads), device=device)

    def observe_attention(self, chunk):
        for i in range(chunk.rows.shape[2]):  # in order: the last query's row stays
            row = chunk.rows[:, :, i].mean(1, keepdim=True).expand(-1, self.kv_heads, -1)
            self.table.set(chunk.slot_positions, row, bound=chunk.position_bound, at=(chunk.layer,))

    def score(self, view):
        return self.table.lookup(view.rows, view.positions(), view.layer)


@torch.inference_mode()
def _kept_sets(model, policy, *, defer: bool, budget: int, buffer: int, steps: int = 40):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, seed=3)
    cache.evictor.observer.defer = defer
    key = cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    held = []
    for _ in range(steps):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
        held.append([cache.positions(layer).clone() for layer in range(len(cache.layers))])
    evictions = cache.evictions
    cache.detach()
    return held, evictions


@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen3-gqa"])
@pytest.mark.parametrize("policy", ["h2o", "raas", "thinkv"])
@pytest.mark.parametrize("buffer", [6, 0])
def test_deferred_attention_keeps_the_per_step_sets(model_name, policy, buffer, one_torch_thread):
    model = TINY_MODELS[model_name]()
    options = {"protect_prompt": False} if policy == "raas" else {"refresh": 8} if policy == "thinkv" else {}
    chosen = reasonkv.get_policy(policy, **options)
    deferred, evictions = _kept_sets(model, chosen, defer=True, budget=12, buffer=buffer)
    per_step, _ = _kept_sets(model, chosen, defer=False, budget=12, buffer=buffer)
    assert evictions >= 3 * (3 if buffer else 20)
    for step, (a, b) in enumerate(zip(deferred, per_step, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"


@pytest.mark.parametrize("buffer", [6, 0])
def test_tova_at_eviction_keeps_the_per_step_tables_sets(buffer, one_torch_thread):
    model = TINY_MODELS["llama-gqa"]()
    at_eviction, evictions = _kept_sets(model, "tova", defer=True, budget=12, buffer=buffer)
    per_step, _ = _kept_sets(model, _TovaPerStep(), defer=False, budget=12, buffer=buffer)
    assert evictions >= 9
    for step, (a, b) in enumerate(zip(at_eviction, per_step, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
