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

    At each eviction, for every layer and kv head, the stored keys ``K`` and values ``V`` (``slots x d``)
    are sketched as ``K G`` and ``V G`` with a Gaussian ``G in R^{d x r}``, entries ``N(0, 1/r)``, fixed for
    the run (one per row, layer and kv head, keyed by the row's seed and the layer; ``vase-dkv`` redraws it
    at every eviction). Each token's key and value leverage are normalised within local windows of
    ``local_window`` tokens and multiplied. The leverage of a sketch: ``"columns"`` (default) takes squared
    row norms after scaling each column to unit norm over the head's real tokens (the true leverage when
    the columns are orthogonal), ``"orthonormal"`` the exact leverage of ``X G`` (what a QR or SVD gives),
    ``"norm"`` the squared row norms of the raw sketch, as the authors' released scorer. Where the paper
    leaves room: ``docs/policy-choices.md``.

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
        # layer -> the (G_k, G_v) of the latest eviction, [rows, kv_heads, d, r] each (for inspection)
        self.projections: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def reset(self, info, batch: int, device: torch.device) -> None:
        self.projections = {}

    # -- the sketch ------------------------------------------------------------------------------
    def sketch_seeds(self, view) -> torch.Tensor:
        """The sketch's seed of each evicted row: the same at every eviction (keyed by the row's seed and layer)."""
        return noise.mix(view.row_seeds, view.layer)

    def score(self, view) -> torch.Tensor:
        # (G_k, G_v) keyed by sketch_seeds, [rows, kv_heads, d, r] each; one sketch for both when d agrees.
        keys, values = view.keys(), view.values()
        key_projection = value_projection = None
        if self.rank > 0:
            seeds = self.sketch_seeds(view)
            key_projection = value_projection = gaussian_projection(seeds, keys.shape[1], keys.shape[-1], self.rank)
            if values.shape[-1] != keys.shape[-1]:
                value_projection = gaussian_projection(seeds, keys.shape[1], values.shape[-1], self.rank, stream=1)
        self.projections[view.layer] = None if key_projection is None else (key_projection, value_projection)
        return dkv_scores(
            keys,
            values,
            view.valid,
            key_projection=key_projection,
            value_projection=value_projection,
            method=self.leverage,
            local_window=self.local_window,
            combine=self.combine,
        )
