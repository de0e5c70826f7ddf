"""SnapKV: keep, per (layer, kv-head), the keys the most recent queries attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.common import group_mean, pool1d
from reasonkv.policies.options import check_choice, check_option
from reasonkv.policies.registry import register

__all__ = ["SnapKV", "window_scores", "pooled_window_scores", "pool_valid", "POOLINGS"]

POOLINGS = ("max", "avg")


def pool_valid(scores: torch.Tensor, valid: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Same-length 1-D pooling over the slot axis that sees real tokens only.

    Padding slots neither raise a max nor dilute an average (``"avg"`` averages over the real
    tokens inside the kernel), so a row pools the same in a batch as alone. Padding scores 0.
    """
    valid = valid.expand_as(scores)
    if mode == "max":
        pooled = pool1d(scores.float().masked_fill(~valid, float("-inf")), kernel, "max")
    else:
        weight = valid.float()
        pooled = pool1d(scores.float() * weight, kernel, "avg") / pool1d(weight, kernel, "avg").clamp(min=1e-30)
    return pooled.masked_fill(~valid, 0.0)


def window_scores(view, *, kernel: int = 7, pooling: str = "max") -> torch.Tensor:
    """SnapKV / VASE-AttnV base scores of one layer, ``[rows, kv_heads, slots]``: the recorded window's
    attention (:meth:`EvictionView.window_attention`) through :func:`pooled_window_scores`."""
    return pooled_window_scores(
        view.window_attention(), view.valid, view.info.num_kv_heads, kernel=kernel, pooling=pooling
    )


def pooled_window_scores(
    probs: torch.Tensor, valid: torch.Tensor, kv_heads: int, *, kernel: int = 7, pooling: str = "max"
) -> torch.Tensor:
    """SnapKV's scores from the window's attention ``probs`` ``[rows, query_heads, w, slots]`` over the slots
    ``valid`` ``[rows, slots]`` marks real: summed over the window, averaged per kv group, pooled along the
    slots. ``[rows, kv_heads, slots]``."""
    grouped = group_mean(probs.sum(dim=2), kv_heads)
    return pool_valid(grouped, valid.unsqueeze(1), kernel, pooling)


@register
@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., 2024) at decode time: per (layer, kv-head), keep the top-``K`` keys by the
    pooled attention they receive from the ``query_window`` most recent queries.

    The window's attention is summed over its ``w`` queries, averaged over the query heads of each kv group
    and smoothed along the slots (:func:`window_scores`); the top-scoring tokens fill what the protected
    ones leave of the budget.

    Parameters
    ----------
    sinks
        First positions never evicted (default 4).
    window
        The most recent tokens never evicted. Default 32 = the default ``query_window``, as SnapKV
        always keeps its observation window (``docs/budget.md``: window defaults to the policy's
        observation window). It does not follow ``query_window`` automatically: set both to change both.
    protect_prompt
        Never evict prompt tokens (default off: the budget covers prompt and output).
    query_window
        ``w``, how many recent queries score the keys (default 32, SnapKV's observation window).
    kernel
        Width of the pooling along the slots (default 7, SnapKV's; odd; 1 = no pooling). After
        per-head evictions adjacent slots of a head hold the tokens that head kept, in order, so the
        pooling smooths over that head's kept neighbours (what decode-time SnapKV does on its cache).
    pooling
        ``"max"`` (default, SnapKV's released code) or ``"avg"``. Either sees real tokens only.
    """

    name = "snapkv"
    granularity = "head"
    chunk_exact = True
    summary = "attention of the last w queries (pooled), top-k per kv head"
    paper = "https://arxiv.org/abs/2404.14469"

    window: int = 32
    query_window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()  # VASE-AttnV checks these options here too
        kernel = self.kernel
        check_option(self, "kernel", kernel > 0 and kernel % 2 == 1, "a positive odd integer (1 = no pooling)")
        check_choice(self, "pooling", POOLINGS)

    def score(self, view) -> torch.Tensor:
        return window_scores(view, kernel=self.kernel, pooling=self.pooling)
