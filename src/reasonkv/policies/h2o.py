"""H2O: heavy hitters (accumulated attention) plus the most recent tokens (Zhang et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies import select
from reasonkv.policies.base import Policy
from reasonkv.policies.common import LayerHeadTable, group_mean
from reasonkv.policies.contract import AttentionChunk, Needs
from reasonkv.policies.options import check_option
from reasonkv.policies.registry import register

__all__ = ["H2O", "received_attention"]


def received_attention(column_sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """What one forward adds to H2O's scores: the attention each key received from the forward's queries
    (``column_sums`` ``[rows, query_heads, slots]``), averaged over the query heads of its kv head."""
    return group_mean(column_sums, kv_heads)


@register
@dataclass
class H2O(Policy):
    """Keep the heavy hitters (most attention received so far) and the most recent tokens.

    H2O ("Heavy-Hitter Oracle", Zhang et al., 2023) scores every cached token by the attention it
    has accumulated from every query since it arrived (``Needs.attention_sum``), and splits the budget
    between the highest-scoring tokens (heavy hitters) and a window of the most recent tokens. The sums
    live in a table indexed by logical position, one per (layer, kv-head), so eviction never moves them.

    Where the paper leaves room: ``docs/policy-choices.md``.

    Parameters
    ----------
    recent_ratio
        Fraction of the budget ``K`` reserved for the most recent tokens (default 0.5, the paper's
        even heavy/recent split). Must be in ``[0, 1)``.
    sinks
        The first ``sinks`` logical positions are never evicted (default 4, the project default;
        the paper has none).
    window
        A fixed number of most recent tokens to protect; the recent part is
        ``max(window, floor(recent_ratio * K))`` (default 0: the ratio decides).
    protect_prompt
        Never evict prompt tokens (default off: the budget covers prompt and output).
    """

    recent_ratio: float = 0.5

    name = "h2o"
    granularity = "head"
    summary = "accumulated attention (heavy hitters) + the most recent half of the budget"
    paper = "https://arxiv.org/abs/2306.14048"
    # The column sums of n queries in one forward equal the sum of n single-query steps over the
    # same stored keys (causal), so chunked replays leave the same scores.
    chunk_exact = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_option(self, "recent_ratio", 0 <= self.recent_ratio < 1, "a number in [0, 1)")
        # The running scores, [batch, full-attention layers, kv_heads, positions] (set by reset).
        self.accumulated: LayerHeadTable | None = None

    def needs(self, info) -> Needs:
        return Needs(attention_sum=True)

    def reset(self, info, batch: int, device: torch.device) -> None:
        self.accumulated = LayerHeadTable(info, batch, device=device)

    def observe_attention(self, chunk: AttentionChunk) -> None:
        table = self.accumulated
        mass = received_attention(chunk.column_sums, table.kv_heads)  # [batch, kv_heads, slots]
        table.add(chunk.slot_positions, mass, bound=chunk.position_bound, at=(table.row[chunk.layer],))

    def recent(self, budget: int) -> int:
        """How many of the most recent tokens are protected under budget ``K``."""
        return max(self.window, int(self.recent_ratio * budget))

    def score(self, view) -> torch.Tensor:
        return self.accumulated.lookup(view.rows, view.positions(), self.accumulated.row[view.layer])

    def ranking(self, view) -> torch.Tensor:
        protected = view.protected(window=self.recent(view.budget))
        return select.rank_top(self.score(view), valid=view.valid_mask(), protected=protected)
