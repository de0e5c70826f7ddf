"""TOVA: keep the tokens the newest query attends to most (Oren et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.common import group_mean
from reasonkv.policies.contract import Needs
from reasonkv.policies.registry import register

__all__ = ["TOVA", "newest_query_scores"]


def newest_query_scores(attention: torch.Tensor, kv_heads: int, layerwise: bool = True) -> torch.Tensor:
    """TOVA's scores from the newest query's attention row ``[rows, query_heads, slots]``: ``[rows, kv_heads,
    slots]``, the mean over the layer's query heads in every kv head (``layerwise``) or over each kv group."""
    if layerwise:
        return attention.mean(1, keepdim=True).expand(-1, kv_heads, -1)
    return group_mean(attention, kv_heads)


@register
@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: keep the tokens with the highest attention from the newest query.

    TOVA ("Transformers are Multi-State RNNs", Oren et al., 2024) treats a bounded cache as a
    multi-state RNN: whenever the cache is over its limit, it drops the token that the current
    query attends to least, with the attention *averaged over the heads of the layer*. It keeps
    no history: only the newest query's attention counts (recorded as a window of one, so nothing is
    computed between evictions).

    Where the paper leaves room: ``docs/policy-choices.md``.

    Parameters
    ----------
    layerwise
        Average over all query heads of the layer and keep the same tokens in every kv head
        (default True, as in the paper); False: average per kv group.
    """

    layerwise: bool = True

    name = "tova"
    granularity = "head"
    summary = "attention of the newest query, averaged over the layer's heads"
    paper = "https://arxiv.org/abs/2401.06104"
    # Only the last query of a forward counts, and it sees the same stored keys whether the tokens
    # before it came in one forward or one by one, so chunked replays leave the same scores.
    chunk_exact = True

    def needs(self, info) -> Needs:
        return Needs(query_window=1)

    def score(self, view) -> torch.Tensor:
        newest = view.window_attention()[:, :, -1]  # the newest query's row, [rows, query_heads, slots]
        return newest_query_scores(newest, view.info.num_kv_heads, self.layerwise)
