"""KeyDiff: scores against the paper's rule (negative cosine similarity to the mean normalised key) on fixed
tensors; padding moves nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import reasonkv
from fixed_view import FixedCache, fixed_view, model_info

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 10


def _reference(keys: torch.Tensor) -> torch.Tensor:
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def test_scores_equal_the_rule_on_fixed_tensors():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, KV_HEADS, SLOTS, DIM, generator=g) + torch.tensor([2.0] + [0.0] * (DIM - 1))
    positions = torch.arange(SLOTS).view(1, 1, SLOTS).expand(2, KV_HEADS, SLOTS)
    policy = reasonkv.get_policy("keydiff")
    info = model_info(1, HEADS, KV_HEADS, DIM, None)
    view = fixed_view(FixedCache([keys], [torch.zeros_like(keys)], positions, budget=4), policy, info)
    torch.testing.assert_close(policy.score(view), _reference(keys))
    kept = policy.keep(view)
    expected = _reference(keys).masked_fill(positions < policy.sinks, float("inf")).topk(4, dim=-1).indices
    assert torch.equal(kept, expected.sort(-1).values)


def test_padding_enters_neither_the_anchor_nor_the_scores():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g)
    padded = torch.cat([torch.randn(1, KV_HEADS, 3, DIM, generator=g) * 50, keys], dim=2)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, SLOTS, dtype=torch.bool)], dim=1)
    positions = torch.cat([torch.full((3,), -1), torch.arange(SLOTS)]).view(1, 1, -1).expand(1, KV_HEADS, -1)
    policy = reasonkv.get_policy("keydiff")
    info = model_info(1, HEADS, KV_HEADS, DIM, None)
    view = fixed_view(FixedCache([padded], [padded], positions, budget=4, valid=valid), policy, info)
    torch.testing.assert_close(policy.score(view)[..., 3:], _reference(keys))
