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
    has accumulated from every query since it arrived, and splits the budget between the
    highest-scoring tokens (heavy hitters) and a window of the most recent tokens.

    How the score is computed here: the attention every query paid to the stored keys
    (``Needs.attention_sum``: the column sums over all prompt queries at prefill, causal; each
    decode step's query row, recomputed in one batched pass before the next eviction with exactly
    the keys it saw), from the recorded queries and the cached keys. The model itself runs SDPA /
    FlashAttention and is never asked for attention weights. The sums are added into a table
    indexed by logical position, one per (layer, kv-head), so eviction never has to move them.

    Choices where the paper leaves room
    -----------------------------------
    - **Accumulation**: a running *sum* over every query that saw the token (the prompt queries
      included), never normalised by how many queries that was, as in the reference
      implementation (which initialises the scores with the prefill attention summed over
      queries and adds each decode step's row). Older tokens therefore have had more chances to
      collect mass; the recent window is what balances that. A token's score stops growing once
      it is evicted (it is never read again).
    - **Grouped-query attention**: H2O predates GQA and scores per attention head. Here scores
      live per kv head and are the *mean* over the query heads that share it. Within one kv head
      the sum would rank tokens identically (it is the mean times the group size); the mean keeps
      the scale of a multi-head model's per-head score.
    - **Heavy / recent split**: the paper's experiments split the budget evenly (for example a
      20% cache = 10% heavy hitters + 10% recent tokens; its code's ``heavy_ratio`` and
      ``recent_ratio`` are equal), so ``recent_ratio = 0.5``: the newest ``floor(0.5 * K)``
      tokens are protected and the heavy hitters fill the rest. Sinks (project default 4) come out
      of the heavy half; ``sinks=0`` reproduces the paper.
    - **Schedule**: H2O evicts one token per step; here eviction runs when a row reaches
      ``K + B`` and shrinks it to ``K``. ``buffer=0`` gives H2O's one-token-per-step greedy
      eviction exactly.
    - **Hybrid models**: H2O accumulates, per layer, the attention that layer's queries pay to the
      tokens of its own cache. Only full-attention layers are evicted, so the attention is
      recomputed and read in those layers only (their cache is what the scores rank); sliding-window
      and linear-attention layers keep their model's own rules. Learned attention sinks and logit
      soft-capping enter the recomputed softmax as in the model's kernel.

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

    Attributes
    ----------
    accumulated
        The running scores, a :class:`LayerHeadTable` ``[batch, full-attention layers, kv_heads, positions]``
        (set by :meth:`reset`).
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
        protected = select.protected_mask(
            view.positions(),
            sinks=self.sinks,
            window=self.recent(view.budget),
            newest=view.newest,
            prompt_lengths=view.prompt_lengths if self.protect_prompt else None,
        )
        return select.rank_top(self.score(view), valid=view.valid_mask(), protected=protected)
