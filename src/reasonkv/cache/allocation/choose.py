"""The slots each (row, kv-head) keeps under an allocation, from the policy's ranking (torch only).

A ranking is ``[rows, kv_heads, slots]`` as :meth:`reasonkv.policies.Policy.ranking` returns it (protected at
``MUST_KEEP``, padding at ``NEVER_KEEP``). Static tables: head ``h`` keeps its ``k_h`` best, or every real
slot when it holds fewer (:func:`static_counts`). ``adaptive`` (AdaKV; kvpress's ``AdaKVPress`` rule): each
head keeps its ``floor = ceil(alpha x K)`` best, then the rest of the layer's ``K x kv_heads`` goes to the
best remaining slots of any head (:func:`adaptive_counts`); ``alpha = 1`` is the uniform split. Ties go as
:func:`reasonkv.policies.select.rank_order` (the higher index, the later head, first); a head whose
protected slots exceed its count keeps the best of them, so a small head never refuses an eviction."""

from __future__ import annotations

import math

import torch

from reasonkv.policies.select import NEVER_KEEP, rank_order

__all__ = ["adaptive_counts", "adaptive_floor", "keep_counted", "static_counts"]


def adaptive_floor(alpha: float, budget: int) -> int:
    """The tokens every head keeps before the layer-wide selection: ``ceil(alpha x K)``."""
    return min(budget, math.ceil(alpha * budget - 1e-9))


def _real(ranking: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads]``: real (not padding) slots per head."""
    return (ranking > NEVER_KEEP).sum(-1)


def static_counts(ranking: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads]``: each head's budget (``budgets`` ``[kv_heads]``, or ``[rows, kv_heads]`` when rows
    differ), or its real slots when fewer."""
    return torch.minimum(_real(ranking), budgets.to(ranking.device).view(-1, ranking.shape[1]))


def adaptive_counts(ranking: torch.Tensor, total: int, floor: int) -> torch.Tensor:
    """``[rows, kv_heads]``: how many slots each head keeps when the layer keeps ``total`` (or every real slot,
    when it holds fewer): each head's ``floor`` best, then the best of the rest over all heads."""
    rows, heads, slots = ranking.shape
    real = _real(ranking)
    base = real.clamp(max=floor)
    order = rank_order(ranking)  # [rows, heads, slots], best first within each head
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=ranking.device).expand_as(order))
    # The slots past each head's floor compete layer-wide; the others are out of this round.
    extra = ranking.masked_fill(rank < floor, NEVER_KEEP).masked_fill(ranking <= NEVER_KEEP, NEVER_KEEP)
    take = (real.sum(-1).clamp(max=total) - base.sum(-1)).clamp(min=0)  # [rows]
    best = rank_order(extra.view(rows, heads * slots))  # [rows, heads x slots], best first over the layer
    chosen = torch.arange(heads * slots, device=ranking.device).view(1, -1) < take.view(-1, 1)
    gained = torch.zeros_like(base).scatter_add_(1, best // slots, chosen.long())
    return base + gained


def keep_counted(ranking: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The ``counts`` ``[rows, kv_heads]`` highest-ranked slots of each head, ascending, as ``[rows, kv_heads,
    width]`` (``width`` at least every count): a head keeping fewer has ``-1`` (no token) in its first entries."""
    slots = ranking.shape[-1]
    order = rank_order(ranking)[..., : min(width, slots)]
    taken = torch.arange(order.shape[-1], device=ranking.device) < counts.unsqueeze(-1)
    kept = torch.where(taken, order, torch.full_like(order, -1)).sort(dim=-1).values
    if width > slots:
        kept = torch.nn.functional.pad(kept, (width - slots, 0), value=-1)
    return kept
