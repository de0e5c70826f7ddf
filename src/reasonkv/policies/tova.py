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
    no history: only the newest query's attention counts.

    How the score is computed here: at eviction, the attention row of the newest query over the
    stored keys, recomputed from that query (recorded as a window of one, ``Needs.query_window``)
    and the cached keys; the model runs SDPA / FlashAttention and is never asked for attention
    weights, and nothing is computed at the steps between evictions.

    Choices where the paper leaves room
    -----------------------------------
    - **Layer-wise token set** (``layerwise=True``, the default): the paper averages over all
      heads of a layer and keeps one token set per layer, reporting that this beats a per-head
      policy. The cache here holds a set per (layer, kv-head), so the layer's mean score is
      broadcast to every kv head, which then keep identical positions. ``layerwise=False`` is the
      per-kv-group alternative (the mean over the query heads sharing each kv head).
    - **Schedule**: TOVA drops one token per step; here a row is shrunk from ``K + B`` to ``K``
      using the attention of the newest query at that moment. ``buffer=0`` gives TOVA's
      one-token-per-step rule exactly (the newest token competes too, as in the paper).
    - **Protection**: the paper protects nothing (it observes that the first token is kept on its
      own). This project's defaults apply (``sinks = 4``, ``window = 0``); ``sinks=0``
      reproduces the paper.
    - **Hybrid models**: TOVA reads each layer's newest-query attention over that layer's cache.
      Only full-attention layers are evicted, so the attention is recomputed and read in those
      layers only (their cache is what the scores rank); sliding-window and linear-attention layers
      keep their model's own rules. Learned attention sinks and logit soft-capping enter the
      recomputed softmax as in the model's kernel.

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
