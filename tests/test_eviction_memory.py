"""R-KV and ThinKV read every layer's keys at an eviction: in pieces of a bounded workspace, so the largest
tensor an eviction makes does not grow with the number of layers (it was a copy of every layer's keys)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reasonkv
from conftest import tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies import rkv, thinkv

PROMPTS = [[5 + (7 * i + r) % 80 for i in range(n)] for r, n in enumerate((44, 38, 41))]
BUDGET, BUFFER = 40, 6


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op makes inside the block (views of their inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.most = max(self.most, t.numel())
        return out


@torch.inference_mode()
def _largest_at_eviction(policy: str, layers: int, **options) -> int:
    model = tiny_llama(layers=layers)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    cache = reasonkv.EvictingCache(BUDGET, BUFFER, model=model, policy=policy, **options)
    key = cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    most = 0
    for _ in range(20):
        before = cache.evictor.eviction_count
        with _Largest() as largest:
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
        if cache.evictor.eviction_count > before:
            most = max(most, largest.most)
    cache.detach()
    assert most, "no eviction was measured"
    return most


@pytest.mark.parametrize(
    ("policy", "options"),
    # ThinKV with fixed thresholds: its online density estimate makes a larger tensor, of any model's size.
    [("rkv", {}), ("thinkv", {"refresh": 8, "thresholds": (0.3, 0.6)})],
    ids=["rkv", "thinkv"],
)
def test_an_eviction_reads_every_layer_in_pieces_of_a_bounded_workspace(policy, options, monkeypatch, one_torch_thread):
    # A workspace of about one layer's keys of the evicted rows (3 rows x 2 kv heads x 46 slots x 16).
    for module in (rkv, thinkv):
        monkeypatch.setattr(module, "WORKSPACE_ELEMENTS", 3 * 2 * 46 * 16, raising=False)
    four, eight = _largest_at_eviction(policy, 4, **options), _largest_at_eviction(policy, 8, **options)
    assert eight == four, (four, eight)  # a copy of every layer's keys would be twice as large at 8 layers
