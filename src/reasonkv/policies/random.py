"""Uniform random eviction: the floor every scoring rule must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies import select
from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register


@register
@dataclass
class Random(Policy):
    """Keep the protected tokens and a uniformly random sample of the rest (seeded per row)."""

    name = "random"
    chunk_exact = True
    summary = "uniform random sample (seeded)"
    stochastic = True

    def ranking(self, view) -> torch.Tensor:
        weights = torch.ones_like(view.valid, dtype=torch.float32)
        return select.rank_sampled(
            weights, valid=view.valid, protected=view.protected(), seeds=view.seeds, positions=view.token_positions()
        )
