"""K-norm: keep the tokens whose keys have the smallest L2 norm (Devoto et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register

__all__ = ["KNorm", "key_norm_scores"]


def key_norm_scores(keys: torch.Tensor) -> torch.Tensor:
    """K-norm's score of each key, ``-||k||_2`` (higher = keep): ``[..., slots, head_dim] -> [..., slots]``."""
    return -keys.float().norm(dim=-1)


@register
@dataclass
class KNorm(Policy):
    """Keep, per (layer, kv-head), the tokens with the lowest key L2 norm.

    Devoto et al. ("A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", 2024) observe
    that a low key norm goes with high attention. The score is ``-||k||_2`` (higher = keep), as kvpress's
    knorm press computes it, from the stored keys alone.

    Where the paper leaves room: ``docs/policy-choices.md``.
    """

    name = "knorm"
    granularity = "head"
    summary = "keep the tokens with the lowest key L2 norm, per (layer, kv-head)"
    paper = "https://arxiv.org/abs/2406.11430"
    chunk_exact = True  # stateless: reads only the stored keys at eviction time

    def score(self, view) -> torch.Tensor:
        return key_norm_scores(view.keys())
