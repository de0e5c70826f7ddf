"""The quantized tier: "keep, but in fewer bytes", between keeping a token and evicting it (torch only).

At every eviction :func:`split_tiers` splits each head's tokens by the policy's ranking: the first ``K``
still at full precision stay there, the next ``Q`` (tier tokens included) are held in the tier (demoting
full-precision ones), the rest are dropped. A tier token is never promoted back. Storage is
:mod:`reasonkv.cache.quantized_tier`, the formats :mod:`reasonkv.cache.quantize`; docs/quantized-tier.md."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from reasonkv.cache.quantize import QuantFormat
from reasonkv.policies.select import MUST_KEEP, NEVER_KEEP, check_counts, rank_order
from reasonkv.suggest.integers import is_int

__all__ = [
    "TierSplit",
    "budget_for_bytes",
    "check_settings",
    "equivalent_budget",
    "full_token_bytes",
    "quantized_token_bytes",
    "split_tiers",
]

GROUP_ID_BYTES = 2  # int16 key-group ids (int32 only for a tier of 32k groups or more per head)


def check_settings(quantized: int, bits: int | None, group_size: int | None = None) -> None:
    """``quantized`` a non-negative integer; ``bits`` 4 or 8 and ``group_size`` positive, only with a tier."""
    if not is_int(quantized) or quantized < 0:
        raise ValueError(f"quantized must be a non-negative integer (tokens kept quantized), got {quantized!r}")
    if not quantized:
        for name, value in (("bits", bits), ("group_size", group_size)):
            if value is not None:
                raise ValueError(f"{name}={value!r} has no effect without a quantized tier: set quantized > 0")
        return
    QuantFormat(8 if bits is None else bits, 1 if group_size is None else group_size)


class TierSplit(NamedTuple):
    """Where each token goes at one eviction (indices into the slots the policy ranked)."""

    full: torch.Tensor  # [..., K] ascending: kept at full precision
    quantized: torch.Tensor  # [..., m] ascending, right-aligned, -1 = nothing: kept quantized
    counts: torch.Tensor  # [...]: real entries of `quantized` per leading index


def split_tiers(
    priority: torch.Tensor, held_quantized: torch.Tensor, *, full: int, quantized: int, width: int | None = None
) -> TierSplit:
    """Split the slots of each leading index into full precision, the quantized tier and dropped.

    ``priority`` ``[..., S]`` is :meth:`Policy.ranking` (higher kept first; protected ``MUST_KEEP``, padding
    ``NEVER_KEEP``); ``held_quantized`` the slots already in the tier (broadcast); ``full``, ``quantized``: ``K``,
    ``Q``; ``width``: columns of ``TierSplit.quantized`` (host-known, at least the largest count; None reads it).

    In priority order (ties: the newer token first, as :func:`reasonkv.policies.select.top_indices`), the full
    tier gets the first ``K`` tokens not in the tier and the tier the next ``Q`` of the others; for a sampling
    policy that is one sample without replacement. Too many protected tokens, or too few at full precision,
    raise ``ValueError`` (inside :func:`reasonkv.policies.select.checks_at_exit`)."""
    held = torch.broadcast_to(held_quantized, priority.shape)
    order = rank_order(priority)
    ranked = priority.gather(-1, order)
    real = ranked > NEVER_KEEP
    candidate = real & ~held.gather(-1, order)
    if ranked.numel():
        counts = torch.stack([(ranked >= MUST_KEEP).sum(-1).max(), candidate.sum(-1).min()])
        check_counts(counts, lambda protected, candidates: _check_split(protected, candidates, full, quantized))
    to_full = candidate & (candidate.cumsum(-1) <= full)
    rest = real & ~to_full
    to_low = rest & (rest.cumsum(-1) <= quantized)
    slots = priority.shape[-1]
    kept_full = torch.where(to_full, order, slots).sort(dim=-1).values[..., :full]
    counts = to_low.sum(-1)
    if width is None:
        width = int(counts.max()) if counts.numel() else 0
    kept_low = torch.where(to_low, order, -1).sort(dim=-1).values[..., slots - width :]
    return TierSplit(kept_full, kept_low, counts)


def _check_split(protected: int, candidates: int, full: int, quantized: int) -> None:
    if protected > full + quantized:
        raise ValueError(
            f"{protected} protected tokens exceed the budget K + Q = {full} + {quantized}: lower sinks/window, "
            "turn off protect_prompt, or raise the budget or the quantized tier"
        )
    if candidates < full:
        raise ValueError(f"cannot keep {full} full-precision tokens from a row holding only {candidates}")


# ------------------------------------------------------------------------------------------ bytes


def full_token_bytes(head_dim: int, dtype_size: int) -> int:
    """Bytes of one full-precision token in one (layer, kv-head): its key and value."""
    return 2 * head_dim * dtype_size


def quantized_token_bytes(head_dim: int, dtype_size: int, fmt: QuantFormat) -> float:
    """Nominal bytes of one quantized token in one (layer, kv-head): its key and value codes, its value groups'
    scales and zero points, its share of a whole key group's, and its group id (what a tier really holds is
    :meth:`~reasonkv.cache.quantized_tier.QuantizedTier.row_bytes`)."""
    codes = 2 * head_dim * fmt.bits / 8
    value_stats = 2 * (head_dim // fmt.group_size) * dtype_size
    key_stats = 2 * head_dim * dtype_size / fmt.group_size
    return codes + value_stats + key_stats + GROUP_ID_BYTES


def _tier_share(quantized: int, fmt: QuantFormat, head_dim: int, dtype_size: int) -> float:
    """The full-precision tokens ``quantized`` tier tokens cost, nominally."""
    return quantized * quantized_token_bytes(head_dim, dtype_size, fmt) / full_token_bytes(head_dim, dtype_size)


def equivalent_budget(budget: int, quantized: int, fmt: QuantFormat, head_dim: int, dtype_size: int) -> float:
    """The full-precision budget with the same nominal K/V bytes as ``budget`` + ``quantized`` tokens."""
    return budget + _tier_share(quantized, fmt, head_dim, dtype_size)


def budget_for_bytes(budget: int, quantized: int, fmt: QuantFormat, head_dim: int, dtype_size: int) -> int:
    """The full-precision budget that, beside ``quantized`` tier tokens, holds at most the nominal bytes of
    ``budget`` full-precision tokens."""
    return budget - math.ceil(_tier_share(quantized, fmt, head_dim, dtype_size) - 1e-9)
