"""Host synchronisation: a decode step between evictions forces no more host reads than a plain
transformers step, and an eviction a fixed few, whatever the batch and the number of layers.

On CUDA, an op whose result the host must read (``.item()``, ``bool()``, ``nonzero``, ``.tolist()``,
a copy of a host-built tensor to the device) stalls the host until the GPU catches up. The same ops
exist on the CPU, so counting them here (with a ``TorchDispatchMode``) catches them coming back.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reasonkv
from conftest import FAST_POLICIES, fast_few, tiny_gemma3, tiny_gpt_oss, tiny_llama, tiny_qwen3_next
from reasonkv.hf import cache_keyword, native_cache
from reasonkv.policies import get_policy, list_policies

# ops that make the host wait for the device
_SYNCING = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.nonzero.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.masked_select.default",
    "aten.repeat_interleave.Tensor",
    "aten.equal.default",
    "aten.is_nonzero.default",
}


class SyncCounter(TorchDispatchMode):
    """Counts the ops that would synchronise the host with a CUDA device."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        out = func(*args, **(kwargs or {}))
        if name in _SYNCING:
            self.ops.append(name)
        elif name == "aten.lift_fresh.default" and args[0].dim() > 0:
            self.ops.append("host-built tensor")  # torch.tensor(python data): copied from the host
        elif name == "aten.index.Tensor" and any(t is not None and t.dtype == torch.bool for t in args[1]):
            self.ops.append("boolean indexing")  # a nonzero inside
        return out

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(tensor):
            counter.ops.append("tolist")
            return counter._tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


PROMPTS = [[5 + (7 * i) % 80 for i in range(n)] for n in (20, 14, 17)]


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.inference_mode()
def _plain_step_syncs(model) -> int:
    """Syncs of one decode step of plain transformers with its own cache, on the same input."""
    ids, mask = _padded(PROMPTS)
    cache = native_cache(model)  # the cache model.generate builds (a DynamicCache for a plain model)
    key = cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    step_ids = out.logits[:, -1:].argmax(-1)
    mask = torch.cat([mask, torch.ones(len(PROMPTS), 1, dtype=mask.dtype)], 1)
    with SyncCounter() as counter:
        model(input_ids=step_ids, attention_mask=mask, **{key: cache})
    return len(counter.ops)


@torch.inference_mode()
def _steps(model, policy, *, batch_prompts, steps, budget=40, buffer=6, with_mask=False, **cache_options):
    """Sync ops per decode step (a list) and which steps evicted."""
    ids, mask = _padded(batch_prompts)
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, **cache_options)
    key = cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    counts, evicted = [], []
    for _ in range(steps):
        before = cache.evictor.eviction_count
        step_ids = out.logits[:, -1:].argmax(-1)
        kwargs = {}
        if with_mask:  # the way model.generate calls: the whole 2-D padding mask at every step
            mask = torch.cat([mask, torch.ones(len(batch_prompts), 1, dtype=mask.dtype)], 1)
            kwargs["attention_mask"] = mask
        with SyncCounter() as counter:
            out = model(input_ids=step_ids, **{key: cache}, **kwargs)
        counts.append(counter.ops)
        evicted.append(cache.evictor.eviction_count > before)
    cache.detach()
    return counts, evicted


EVICTING = [name for name in list_policies() if get_policy(name).evicts]


@pytest.mark.parametrize("policy", fast_few(["full", *EVICTING], fast=("full", *FAST_POLICIES)))
@pytest.mark.parametrize("with_mask", [False, True], ids=["own-loop", "generate-style"])
def test_a_step_between_evictions_syncs_no_more_than_plain_transformers(policy, with_mask, one_torch_thread):
    model = tiny_llama()
    plain = _plain_step_syncs(model)
    counts, evicted = _steps(model, policy, batch_prompts=PROMPTS, steps=36, with_mask=with_mask)
    quiet = [ops for ops, e in zip(counts, evicted, strict=True) if not e]
    assert quiet, "no step without an eviction was measured"
    assert max(len(ops) for ops in quiet) <= plain, (plain, [ops for ops in quiet if len(ops) > plain][:1])
    if policy != "full":
        assert any(evicted)


@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_an_eviction_syncs_a_fixed_few_whatever_the_batch_and_layers(policy, one_torch_thread):
    def eviction_syncs(layers, rows):
        model = tiny_llama(layers=layers)
        counts, evicted = _steps(model, policy, batch_prompts=(PROMPTS * 3)[:rows], steps=36)
        return max(len(ops) for ops, e in zip(counts, evicted, strict=True) if e)

    small, big = eviction_syncs(2, 2), eviction_syncs(4, 6)
    assert big == small, (small, big)
    # ThinKV types each new segment and groups segments for its K-means on the host: a few reads more.
    assert big <= (16 if policy == "thinkv" else 6), big


TIER = dict(quantized=16, bits=4, group_size=4)  # a quantized tier beside K = 24


@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_with_a_tier_a_quiet_step_syncs_no_more_than_plain_and_an_eviction_a_fixed_few(policy, one_torch_thread):
    """The tier's sizes are host-side bounds or one read per eviction, whatever the layers (not one per layer)."""

    def syncs(layers, rows):
        model = tiny_llama(layers=layers)
        counts, evicted = _steps(model, policy, batch_prompts=(PROMPTS * 3)[:rows], steps=36, budget=24, **TIER)
        quiet = [len(ops) for ops, e in zip(counts, evicted, strict=True) if not e]
        assert quiet and max(quiet) <= _plain_step_syncs(model), quiet
        return max(len(ops) for ops, e in zip(counts, evicted, strict=True) if e)

    small, big = syncs(2, 2), syncs(6, 6)
    assert big == small, (small, big)
    assert big <= (17 if policy == "thinkv" else 8), big


@pytest.mark.parametrize("make", [tiny_gemma3, tiny_gpt_oss, tiny_qwen3_next], ids=["gemma3", "gpt-oss", "qwen3-next"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["own-loop", "generate-style"])
def test_on_a_hybrid_model_a_quiet_step_syncs_no_more_than_plain_transformers(make, with_mask, one_torch_thread):
    model = make()
    plain = _plain_step_syncs(model)
    counts, evicted = _steps(model, "h2o", batch_prompts=PROMPTS, steps=30, budget=16, with_mask=with_mask)
    quiet = [ops for ops, e in zip(counts, evicted, strict=True) if not e]
    assert quiet and any(evicted)
    assert max(len(ops) for ops in quiet) <= plain, (plain, [ops for ops in quiet if len(ops) > plain][:1])
