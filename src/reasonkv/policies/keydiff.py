"""KeyDiff: keep the keys least similar to the head's average key direction; attention-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register

__all__ = ["KeyDiff", "anchor_similarity"]


def anchor_similarity(keys: torch.Tensor, valid: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Cosine similarity of every key to the anchor, ``[..., slots]``.

    ``keys [..., slots, d]``; the anchor is the mean of the L2-normalised keys over the real slots
    (``valid [..., slots]``, broadcast), so padding moves neither the anchor nor any score.
    """
    keys = keys.float()
    weight = valid.to(keys.dtype).unsqueeze(-1)
    unit = keys / keys.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    anchor = (unit * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp(min=1.0)
    dot = (keys * anchor).sum(-1)
    return dot / (keys.norm(dim=-1) * anchor.norm(dim=-1)).clamp(min=eps)


@register
@dataclass
class KeyDiff(Policy):
    """KeyDiff (Park et al., 2025): keep, per (layer, kv-head), the keys that differ most in direction
    from the head's other keys: the score is ``-cos(k, a)``, ``a`` the mean of the L2-normalised keys.

    Distinctive keys are the ones attention picks (the paper). At every eviction the ``K + B`` held
    keys, post-RoPE as cached, form the anchor (padding excluded, protected tokens included) and the ``K``
    most distinctive stay. Where this follows the paper and kvpress: ``docs/policy-choices.md``.
    """

    name: ClassVar[str] = "keydiff"
    granularity: ClassVar[str] = "head"
    chunk_exact: ClassVar[bool] = True  # stateless: reads only the stored keys at eviction time
    summary: ClassVar[str] = "keep the keys least similar (cosine) to the mean normalised key, per (layer, kv-head)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2504.15364"

    def score(self, view) -> torch.Tensor:
        return -anchor_similarity(view.keys(), view.valid_mask())
