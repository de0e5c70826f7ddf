"""StreamingLLM: attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register


@register
@dataclass
class Streaming(Policy):
    """Keep the first ``sinks`` tokens and the most recent ones (Xiao et al., 2024).

    Scoring by logical position keeps, after the sinks, exactly the newest ``K - sinks`` tokens.
    """

    name = "streaming"
    chunk_exact = True
    summary = "attention sinks + most recent tokens"
    paper = "https://arxiv.org/abs/2309.17453"

    def score(self, view) -> torch.Tensor:
        return view.token_positions().float()
