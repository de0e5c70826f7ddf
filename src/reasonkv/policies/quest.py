"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
training-free block selection by an upper bound of the attention logit. A selection policy: the cache
holds every token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.options import check_choice
from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.pooled import PooledKeys
from reasonkv.selection.quest import GROUPINGS, quest_scores


@register
@dataclass
class Quest(SelectionPolicy):
    """Per page the elementwise min and max of its post-RoPE keys (kept as pages fill); a decode step's
    query scores each page by ``sum_d max(q_d * min_d, q_d * max_d)`` and reads the top pages within the
    budget, the current page among them. As Quest runs: pages of 16 tokens, layers 0 and 1 dense.

    Parameters
    ----------
    block_size
        Tokens per page (default 16, Quest's page size).
    dense_layers
        The first this many layers read every token (default 2: Quest's layers 0 and 1 are dense).
    group
        How a kv-head's query heads choose: ``max`` (default: one set of pages per kv-head, the bounds of
        its query heads combined by max: a page is read if any head may attend to it strongly; at equal
        bytes read it keeps more attention than ``head``), ``sum`` (combined by sum), or ``head`` (Quest's
        own rule: each query head chooses its pages; the kv-head reads their union, 1.3-1.4x the distinct
        tokens on SmolLM2, and each head attends only to its own pages).
    """

    name = "quest"
    summary = "selection (holds all tokens): reads the top blocks by a min/max-key bound of q·k"
    paper = "Tang et al., Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, ICML 2024"

    block_size: int = 16
    dense_layers: int = 2
    group: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self, "group", GROUPINGS)

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return quest_scores(query, pooled.minimum, pooled.maximum, self.group), None
