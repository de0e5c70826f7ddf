"""CurDKV: keep, per (layer, kv-head), the tokens of highest key x value leverage (CUR decomposition)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies import noise
from reasonkv.policies.base import Policy
from reasonkv.policies.leverage import COMBINE_METHODS, LEVERAGE_METHODS, dkv_scores, gaussian_projection
from reasonkv.policies.options import check_at_least, check_choice
from reasonkv.policies.registry import register

__all__ = ["CurDKV", "check_dkv_options"]


def check_dkv_options(policy) -> None:
    """Check the ranges of ``rank``, ``leverage``, ``local_window`` and ``combine`` (shared with VASE-DKV)."""
    check_at_least(policy, "rank", 0)
    check_at_least(policy, "local_window", 0)
    check_choice(policy, "leverage", LEVERAGE_METHODS)
    check_choice(policy, "combine", COMBINE_METHODS)


@register
@dataclass
class CurDKV(Policy):
    """CurDKV (Sengupta et al., 2025): per (layer, kv-head), keep the top-``K`` tokens by the product of
    the leverage of their key and of their value, with one Gaussian sketch per run.

    At each eviction, for every layer and kv head, the stored keys ``K`` and values ``V``
    (``slots x d``) are sketched as ``K G`` and ``V G`` with a Gaussian ``G in R^{d x r}``, entries
    ``N(0, 1/r)``. Each token's key leverage and value leverage (see ``leverage``) are normalised
    within local windows of ``local_window`` tokens, multiplied, and the top-scoring tokens fill what
    the protected ones leave of the budget. The policy reads only the cached K/V: no queries, no
    attention. ``G`` is fixed for the run: one ``G`` per (row, layer, kv head), keyed by the row's
    seed and the layer (:mod:`reasonkv.policies.noise`), the same at every eviction (VASE's
    "CUR fixed"; ``vase-dkv`` redraws it at every eviction). The kept set therefore depends on the
    seed unless ``rank=0``.

    Choices where the paper leaves room (all documented options):

    - "Normalised within local windows" follows the authors' released scorer: the slots are cut
      into consecutive, non-overlapping windows of ``local_window`` tokens and each score is divided
      by its window's sum, separately for keys and values, before the product. Windows are counted
      back from the newest real token (as in the authors' code, which pads at the front), so padding
      never shifts them; the oldest window may be shorter. At decode time a head's slots hold the
      tokens that head kept, in order, so a window is ``local_window`` consecutive kept tokens.
    - Leverage: here, the squared row norms of the projected, column-normalised
      matrices; the default ``"columns"`` does exactly that (each column of ``X G`` scaled to unit
      norm over the head's real tokens, then squared row norms; scores sum to ``r``). It equals the
      true leverage of the sketch when the sketch's columns are orthogonal. ``"orthonormal"``
      orthonormalises the columns instead, giving the exact leverage of ``X G`` (what a QR or SVD
      gives); note that it no longer depends on ``G`` once ``r >= head_dim`` (the sketch then spans
      the same space as ``X``). ``"norm"`` is what the authors' released scorer computes: squared row
      norms of the raw sketch, i.e. approximately ``||k||^2`` and ``||v||^2``.
    - One ``G`` per (row, kv head), shared by keys and values (the released scorer shares one
      ``G`` across heads); drawn per row so a prompt scores the same in a batch as alone.
    - ``rank=0`` scores the raw keys and values without a sketch (the default of the kvpress port,
      whose random projection is opt-in); the sketch is what CurDKV scores, so ``r = 20`` is the default.

    Parameters
    ----------
    sinks
        First positions never evicted (default 4; CurDKV pins 4 sink tokens).
    window
        The most recent tokens never evicted (default 0: the scores read no queries, so there is no
        observation window to protect).
    protect_prompt
        Never evict prompt tokens (default off).
    rank
        ``r``, columns of the Gaussian sketch (default 20, CurDKV's). ``0``: no sketch, score the raw
        keys and values (then the policy is deterministic).
    leverage
        How leverage scores are read from the sketch: ``"columns"`` (default), ``"orthonormal"`` or
        ``"norm"``, as above.
    local_window
        Tokens per local normalisation window (default 16, CurDKV's); ``0``: normalise over all tokens.
    combine
        ``"product"`` (default, CurDKV's ``kv_product``), ``"mean"``, ``"key"`` or ``"value"``.
    """

    name = "curdkv"
    granularity = "head"
    chunk_exact = True
    stochastic = True
    summary = "CUR leverage of keys x values (Gaussian sketch fixed per run), top-k per kv head"
    paper = "https://arxiv.org/abs/2509.15038"

    rank: int = 20
    leverage: str = "columns"
    local_window: int = 16
    combine: str = "product"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dkv_options(self)
        self._clear()

    def _clear(self) -> None:
        # layer -> the (G_k, G_v) of the latest eviction, [rows, kv_heads, d, r] each (for inspection)
        self.projections: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def reset(self, info, batch: int, device: torch.device) -> None:
        self._clear()

    # -- the sketch ------------------------------------------------------------------------------
    def _draw(self, seeds: torch.Tensor, heads: int, d_key: int, d_value: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(G_k, G_v)`` keyed by ``seeds`` (one per row), ``[rows, kv_heads, d, r]`` each; shared when d agrees."""
        key_projection = gaussian_projection(seeds, heads, d_key, self.rank, stream=0)
        if d_value == d_key:
            return key_projection, key_projection
        return key_projection, gaussian_projection(seeds, heads, d_value, self.rank, stream=1)

    def projection(self, view) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(G_k, G_v)`` for this eviction's rows: the same at every eviction (keyed by the row's seed and layer)."""
        if self.rank == 0:
            return None
        keys, values = view.keys(), view.values()
        seeds = noise.mix(view.row_seeds, view.layer)
        return self._draw(seeds, keys.shape[1], keys.shape[-1], values.shape[-1])

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, view) -> torch.Tensor:
        projection = self.projection(view)
        self.projections[view.layer] = projection
        key_projection, value_projection = projection if projection is not None else (None, None)
        return dkv_scores(
            view.keys(),
            view.values(),
            view.valid,
            key_projection=key_projection,
            value_projection=value_projection,
            method=self.leverage,
            local_window=self.local_window,
            combine=self.combine,
        )
