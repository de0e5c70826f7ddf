"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
training-free block selection by an upper bound of the attention logit. A selection policy: the cache
holds every token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.pooled import PooledKeys
from reasonkv.selection.quest import GROUPINGS, quest_scores


@register
@dataclass
class Quest(SelectionPolicy):
    """Per block the elementwise min and max of its post-RoPE keys (kept as blocks fill); a decode step's
    query scores each block by ``sum_d max(q_d * min_d, q_d * max_d)`` and reads the top blocks within the
    budget, plus the current block.

    Parameters
    ----------
    group
        How the bounds of a kv-head's query heads combine into its one block choice: ``max`` (default: a
        block is read if any head of the group may attend to it strongly) or ``sum``. Quest itself
        chooses per query head, on models without grouped K/V.
    """

    name = "quest"
    summary = "selection (holds all tokens): reads the top blocks by a min/max-key bound of q·k"
    paper = "Tang et al., Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, ICML 2024"

    group: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group not in GROUPINGS:
            raise ValueError(f"quest: group must be one of {', '.join(GROUPINGS)}, got {self.group!r}")

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return quest_scores(query, pooled.minimum, pooled.maximum, self.group), None
