"""Quest's block score (Tang et al., ICML 2024): an upper bound of a query's dot product with any key of
a block, from the block's elementwise minimum and maximum key.

For a query ``q`` and a block whose keys lie in ``[min_d, max_d]`` in every channel ``d``,
``q · k <= sum_d max(q_d * min_d, q_d * max_d)``. Quest takes this bound per query head and reads the
top pages of each head (``head``). The query heads of a GQA kv-head share its K/V, so by default one set
of blocks is read per kv-head: the bound of each of the group's query heads is taken and the group
combines them by ``max`` (a block is read if any head of the group may attend to it strongly) or ``sum``.
"""

from __future__ import annotations

import torch

__all__ = ["GROUPINGS", "quest_bound", "quest_scores"]

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
    bound = quest_bound(query.view(batch, kv_heads, heads // kv_heads, dim), minimum, maximum)
    if group == "max":
        return bound.amax(dim=2)
    if group == "sum":
        return bound.sum(dim=2)
    if group == "head":
        return bound.flatten(1, 2)
    raise ValueError(f"group must be one of {', '.join(GROUPINGS)}, got {group!r}")
