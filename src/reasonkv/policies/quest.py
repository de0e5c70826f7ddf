"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
training-free block selection by an upper bound of the attention logit. A selection policy: the cache
holds every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.options import check_choice
from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.pooled import PooledKeys

__all__ = ["GROUPINGS", "Quest", "quest_bound", "quest_scores"]

GROUPINGS = ("max", "sum", "head")


def quest_bound(query: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor) -> torch.Tensor:
    """``sum_d max(q_d * min_d, q_d * max_d)`` for ``query`` ``[batch, kv_heads, group, head_dim]`` against
    blocks ``[batch, kv_heads, blocks, head_dim]``: ``[batch, kv_heads, group, blocks]``. Empty blocks
    (infinite bounds) score 0: they are never candidates."""
    low = torch.where(torch.isfinite(minimum), minimum, 0.0)
    high = torch.where(torch.isfinite(maximum), maximum, 0.0)
    q = query.float()
    # max(q * lo, q * hi) is q * hi where q >= 0 and q * lo where q < 0 (lo <= hi).
    return q.clamp(min=0) @ high.transpose(-1, -2) + q.clamp(max=0) @ low.transpose(-1, -2)


def quest_scores(query: torch.Tensor, minimum: torch.Tensor, maximum: torch.Tensor, group: str = "max") -> torch.Tensor:
    """Block scores ``[batch, kv_heads, blocks]`` of the newest query ``[batch, heads, head_dim]`` (post-RoPE)
    from post-RoPE key bounds ``[batch, kv_heads, blocks, head_dim]``, the group's heads combined by ``group``
    (``head``: not combined, ``[batch, heads, blocks]``)."""
    batch, heads, dim = query.shape
    kv_heads = minimum.shape[1]
    if group not in GROUPINGS:
        raise ValueError(f"group must be one of {', '.join(GROUPINGS)}, got {group!r}")
    bound = quest_bound(query.view(batch, kv_heads, heads // kv_heads, dim), minimum, maximum)
    if group == "head":
        return bound.flatten(1, 2)
    return bound.amax(dim=2) if group == "max" else bound.sum(dim=2)


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
