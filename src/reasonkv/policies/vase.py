"""VASE, value-aware stochastic eviction: reserve the largest-range values, sample the rest.

Two variants share the selection rule and differ in the base score they sample from:
``vase-attnv`` (SnapKV's pooled window attention) and ``vase-dkv`` (CurDKV's key x value leverage
with a Gaussian sketch redrawn at every eviction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reasonkv.policies import select
from reasonkv.policies.curdkv import CurDKV
from reasonkv.policies.options import check_option
from reasonkv.policies.registry import register
from reasonkv.policies.snapkv import SnapKV

__all__ = ["VaseAttnV", "VaseDKV", "reserve_count", "value_aware_rank", "value_reserve", "value_signals"]


def reserve_count(reserve: float, budget: int) -> int:
    """``N_v`` for a budget ``K``: ``reserve`` is a fraction of ``K`` when below 1 (``floor(reserve * K)``,
    so 0.125 gives ``K // 8``), a token count when 1 or more."""
    if reserve < 1:
        return int(math.floor(reserve * budget + 1e-9))
    return int(reserve)


def value_reserve(policy, view, ranges: torch.Tensor) -> torch.Tensor:
    """VASE's value-range reserve for one layer, ``[rows, kv_heads, slots]`` bool: the ``N_v`` valid,
    unprotected slots of each head still held at full precision with the largest ``ranges`` (fewer if the
    protected tokens leave less room in the budget; none when ``N_v`` is 0)."""
    # A quantized token cannot be promoted back, so the reservation (full precision) skips it.
    eligible = view.valid_mask() & ~view.quantized_mask()
    n_reserve = reserve_count(policy.reserve, view.budget)
    return select.reserve_top(ranges, valid=eligible, protected=view.protected(), n=n_reserve, k=view.budget)


def value_aware_rank(policy, view, weights: torch.Tensor) -> torch.Tensor:
    """VASE's ranking for one layer: protected tokens, then ``N_v`` reserved by value range, then the fill.

    ``weights`` ``[rows, kv_heads, slots]`` are the base scores. Reservation (:func:`value_reserve`) ranks
    the valid, unprotected tokens of each head still held at full precision by ``max(v) - min(v)`` over
    ``head_dim`` and puts the top ``N_v`` with the protected ones, at the top. The rest are ordered by a
    sample without replacement with probability proportional to ``weight ** (1 / temperature)``
    (Gumbel-top-k, draws keyed by row seed, eviction, layer, head and position), or by the weights when
    ``policy.sample`` is False; keeping the top ``budget`` is VASE's selection.
    """
    valid = view.valid_mask()
    protected = view.protected()
    if reserve_count(policy.reserve, view.budget) > 0:
        protected = protected | value_reserve(policy, view, select.value_range(view.values()))
    if policy.sample:
        return select.rank_sampled(
            weights,
            valid=valid,
            protected=protected,
            seeds=view.seeds,
            positions=view.positions(),
            temperature=float(policy.temperature),
        )
    return select.rank_top(weights, valid=valid, protected=protected)


def value_signals(policy, view) -> dict[str, torch.Tensor]:
    """What VASE reads per token of one layer: each slot's value range and the reserve it earns."""
    ranges = select.value_range(view.values())
    return {"value_range": ranges, "reserve": value_reserve(policy, view, ranges)}


@dataclass
class ValueAware:
    """VASE's selection over a base policy's score (the class it is mixed into, after it): its options
    (appended to the base's), their check, and the ranking and signals they give.

    Parameters
    ----------
    reserve
        ``N_v``, tokens per head kept for their value range ``max(v) - min(v)``: a fraction of the
        budget when below 1 (default 0.125, i.e. ``K // 8``), a count when 1 or more, 0 = off (the
        papers' "no value awareness" ablation). Reserved tokens are picked among the valid tokens
        that protection does not already keep (protected ones are kept anyway), and never more than
        the budget left after protection.
    sample
        Fill the rest of the budget by weighted sampling without replacement (default True);
        False = top-k by the base score (the papers' "no stochasticity" ablation).
    temperature
        Sampling keeps token ``i`` with probability following ``weight_i ** (1 / temperature)``
        (Gumbel-top-k on ``log(weight) / temperature``; default 1: proportional to the base score).
        The draws are keyed by the run's seed, the eviction, the layer, the head and the token's
        position, so the same seed keeps the same sets, on every device, and a prompt makes the same
        draws in a batch as alone.
    """

    stochastic = True
    paper = "https://arxiv.org/abs/2606.03928"

    reserve: float = 0.125
    sample: bool = True
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        reserve, temperature = self.reserve, self.temperature
        check_option(
            self,
            "reserve",
            math.isfinite(reserve) and reserve >= 0 and (reserve < 1 or reserve == int(reserve)),
            "a token count (an integer >= 1), a fraction of the budget in [0, 1), or 0 for no reservation",
        )
        check_option(self, "temperature", math.isfinite(temperature) and temperature > 0, "a positive number")

    def ranking(self, view) -> torch.Tensor:
        return value_aware_rank(self, view, self.score(view))

    def signals(self, view) -> dict[str, torch.Tensor]:
        return value_signals(self, view)


@register
@dataclass
class VaseAttnV(ValueAware, SnapKV):
    """VASE-AttnV: value-aware stochastic eviction with SnapKV-style attention scores, per (layer, kv-head).

    At each eviction, for every layer and kv head: keep the protected tokens (sinks, recent window); reserve
    the ``N_v`` tokens with the largest value range; fill the rest by sampling without replacement, weighted
    by SnapKV's score (``snapkv``). Ablations: ``sample=False`` (top-k), ``reserve=0``.

    Parameters
    ----------
    protect_prompt
        Never evict prompt tokens (default off).
    query_window
        ``w``, recent queries that score the keys (default 32).
    kernel
        Width of the pooling along the slots (default 7; odd; 1 = none).
    pooling
        ``"max"`` (default) or ``"avg"``, over real tokens only.
    """

    name = "vase-attnv"
    summary = "VASE: value-range reservation + sampling by window attention, per kv head"


@register
@dataclass
class VaseDKV(ValueAware, CurDKV):
    """VASE-DKV: value-aware stochastic eviction with CurDKV leverage scores, per (layer, kv-head).

    As ``vase-attnv``, weighted by CurDKV's score (``curdkv``), with ``G`` drawn anew at every eviction
    (keyed by the row's seed, the eviction and the layer), so no token is scored low by the same projection
    every time. Ablations: ``sample=False`` (top-k), ``reserve=0``.

    Parameters
    ----------
    sinks
        First positions never evicted (default 4).
    window
        The most recent tokens never evicted (default 0: it reads no queries, so there is no observation window).
    rank
        ``r``, columns of the Gaussian sketch (default 20); 0 = score the raw keys and values.
    leverage
        ``"columns"`` (default: squared row norms of the column-normalised sketch), ``"orthonormal"``
        (exact leverage of the sketch) or ``"norm"`` (raw sketch, as CurDKV's released scorer).
    local_window
        Tokens per local normalisation window (default 16); 0 = one window.
    combine
        ``"product"`` (default), ``"mean"``, ``"key"`` or ``"value"``.
    """

    name = "vase-dkv"
    summary = "VASE: value-range reservation + sampling by CUR leverage (sketch redrawn per eviction)"

    def sketch_seeds(self, view) -> torch.Tensor:
        """A fresh sketch for every eviction and layer, keyed by each row's seed, eviction and layer."""
        return view.seeds
