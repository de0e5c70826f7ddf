"""How well a block scorer finds the blocks the model attends to most: recall of the true top blocks.

For each (kv-head, query) with at least ``k`` blocks to choose from, the ``k`` blocks of highest target
(the model's max-pooled block attention, :func:`~reasonkv.selection.distill.block_targets`) against the
``k`` a scorer ranks highest; recall is the fraction of the true ones found, averaged over them.
"""

from __future__ import annotations

import torch

__all__ = ["top_block_recall"]


def top_block_recall(scores: torch.Tensor, target: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[float, int]:
    """Mean recall and how many (kv-head, query) pairs it averages; ``scores``/``target`` ``[kv_heads, n, blocks]``,
    ``visible`` ``[n, blocks]``."""
    enough = visible.sum(-1) >= k  # [n]
    if not bool(enough.any()) or k < 1:
        return float("nan"), 0
    mask = ~visible[enough]
    truth = target[:, enough].masked_fill(mask, float("-inf")).topk(k, dim=-1).indices
    picked = scores[:, enough].float().masked_fill(mask, float("-inf")).topk(k, dim=-1).indices
    hits = (truth.unsqueeze(-1) == picked.unsqueeze(-2)).any(-1).float().sum(-1) / k
    return float(hits.mean()), int(hits.numel())
