"""Leverage scores of keys and values through a Gaussian sketch (CurDKV, VASE-DKV): pure tensor maths.

The leverage of row ``i`` of a tall matrix ``X`` is the squared norm of row ``i`` of an orthonormal basis
of its column space; CurDKV (Sengupta et al., 2025) scores each token by the leverage of its key and value
rows on a sketch ``X G`` (``G`` Gaussian, ``d x r``), at ``O(n d r)`` per head. Tensors are
``[rows, heads, slots, dim]`` with a ``[rows, slots]`` validity mask (padding scores 0).
"""

from __future__ import annotations

import math

import torch

from reasonkv.policies import noise

__all__ = [
    "LEVERAGE_METHODS",
    "COMBINE_METHODS",
    "gaussian_projection",
    "sketch",
    "leverage_scores",
    "local_normalise",
    "dkv_scores",
]

LEVERAGE_METHODS = ("columns", "orthonormal", "norm")
COMBINE_METHODS = ("product", "mean", "key", "value")


def gaussian_projection(seeds: torch.Tensor, heads: int, dim: int, rank: int, stream: int = 0) -> torch.Tensor:
    """One Gaussian sketch per row and head, ``[rows, heads, dim, rank]``, entries ``N(0, 1/rank)``.

    Row ``i``'s numbers are keyed by ``seeds[i]`` (int64) and ``stream`` alone, so a row's projection
    depends only on its own seed, not on the batch around it (nor on the device).
    """
    return noise.normal(seeds, (heads, dim, rank), stream) / math.sqrt(rank)


def sketch(x: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
    """``x @ projection`` in float32 (``[rows, heads, slots, dim] @ [rows, heads, dim, r]``); ``None``: ``x``."""
    x = x.float()
    return x if projection is None else torch.matmul(x, projection.to(x.device, torch.float32))


def _row_mask(valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``valid`` ``[rows, slots]`` (or already shaped like ``x[..., 0]``) broadcast to ``x[..., 0]``."""
    while valid.dim() < x.dim() - 1:
        valid = valid.unsqueeze(1)
    return valid.expand(x.shape[:-1])


def leverage_scores(
    x: torch.Tensor, valid: torch.Tensor, *, method: str = "columns", rtol: float = 1e-5
) -> torch.Tensor:
    """Per-row scores of ``x`` ``[..., slots, c]`` (sketched keys or values) over the rows ``valid``
    ``[rows, slots]`` marks: ``[..., slots]`` (padding: 0).

    ``method``: ``"columns"`` (default), squared row norms after scaling each column to unit norm over the
    valid rows (the leverage when the columns are orthogonal); ``"orthonormal"``, the exact leverage
    ``diag(x (x^T x)^+ x^T)``, from the ``c x c`` Gram matrix in float64, directions with singular value below
    ``rtol`` times the largest counting as absent (rank-deficient inputs get the leverage of their numerical
    rank); ``"norm"``, squared row norms of ``x`` itself, as CurDKV's released code scores the sketch.
    """
    mask = _row_mask(valid, x).unsqueeze(-1)
    if method == "norm":
        return (x.float().masked_fill(~mask, 0.0) ** 2).sum(-1)
    if method == "columns":
        y = x.float().masked_fill(~mask, 0.0)
        norms = y.norm(dim=-2, keepdim=True)
        y = torch.where(norms > 0, y / norms.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(y))
        return (y**2).sum(-1)
    y = x.double().masked_fill(~mask, 0.0)
    gram = torch.matmul(y.transpose(-1, -2), y)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    cutoff = eigenvalues.amax(-1, keepdim=True).clamp(min=0) * rtol**2
    kept = eigenvalues > cutoff
    inverse = torch.where(kept, 1.0 / torch.where(kept, eigenvalues, torch.ones_like(eigenvalues)), 0.0)
    coordinates = torch.matmul(y, eigenvectors)  # rows in the eigenbasis of the Gram matrix
    return ((coordinates**2) * inverse.unsqueeze(-2)).sum(-1).float()


def local_normalise(scores: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    """Divide each score by the sum of the scores in its local window of ``window`` real tokens.

    Windows are consecutive, non-overlapping runs of real tokens counted back from the newest one
    (the newest ``window`` tokens form the first window; the oldest window may be shorter), so
    padding slots never shift a window and a row scores the same in a batch as alone. ``window <=
    0``: one window holding every token (a plain normalisation to sum 1). Padding scores 0.
    """
    mask = _row_mask(valid, scores.unsqueeze(-1))
    masked = scores.float().masked_fill(~mask, 0.0)
    slots = scores.shape[-1]
    if window <= 0:
        total = masked.sum(-1, keepdim=True)
        return torch.where(total > 0, masked / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    newer = mask.flip(-1).long().cumsum(-1).flip(-1) - 1  # real tokens after each slot
    group = newer.clamp(min=0) // window
    sums = masked.new_zeros((*masked.shape[:-1], slots // window + 1))
    sums.scatter_add_(-1, group, masked)
    denominator = sums.gather(-1, group)
    return torch.where(denominator > 0, masked / denominator.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def dkv_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    *,
    key_projection: torch.Tensor | None,
    value_projection: torch.Tensor | None,
    method: str = "columns",
    local_window: int = 16,
    combine: str = "product",
) -> torch.Tensor:
    """CurDKV token scores ``[rows, heads, slots]``: key leverage (x) value leverage, each normalised locally.

    ``keys``/``values`` are ``[rows, heads, slots, dim]``; the projections ``[rows, heads, dim, r]``
    (``None``: score the raw keys / values). ``combine``: ``"product"`` (CurDKV's default),
    ``"mean"``, ``"key"`` or ``"value"``.
    """

    def side(x: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
        return local_normalise(leverage_scores(sketch(x, projection), valid, method=method), valid, local_window)

    key_score = side(keys, key_projection) if combine != "value" else None
    value_score = side(values, value_projection) if combine != "key" else None
    if combine == "product":
        return key_score * value_score
    if combine == "mean":
        return 0.5 * (key_score + value_score)
    return key_score if combine == "key" else value_score
