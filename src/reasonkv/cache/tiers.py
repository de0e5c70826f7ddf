"""The quantized tier: "keep, but in fewer bytes", between keeping a token and evicting it (torch only).

With a quantized budget ``Q``, every eviction splits the tokens of each head three ways by the
policy's ranking (:meth:`reasonkv.policies.Policy.ranking`, the order its ``keep`` takes tokens in):

- the first ``K`` still held at full precision stay at full precision (protected tokens and, for
  VASE, the value-range reservation rank first, so they are among them whenever ``K`` holds them);
- the next ``Q`` (counting the tokens already in the tier) are kept in the tier; a full-precision
  token among them is demoted now;
- the rest are dropped.

A token in the tier is never promoted back: it competes at every eviction for the ``Q`` tier slots
only, and once dropped it is gone. :func:`split_tiers` makes the split; how the tier stores its
tokens (codes in key groups, and a pending group at full precision until a whole key group forms)
is :mod:`reasonkv.cache.quantized_tier`, the formats :mod:`reasonkv.cache.quantize`.

Bytes: :func:`quantized_token_bytes` is the nominal cost of a coded token (a whole key group's
statistics shared by ``group_size`` tokens); what a tier really holds (pending tokens at full
precision, key groups that lost members) is measured by the cache
(:meth:`reasonkv.cache.KVStorage.row_kv_bytes_by_tier`).
"""

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
    """Refuse a bad quantized tier before anything is built: ``quantized`` a non-negative integer,
    ``bits`` 4 or 8 and ``group_size`` positive (both only with ``quantized > 0``)."""
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

    Parameters
    ----------
    priority
        ``[..., S]`` from :meth:`Policy.ranking`: higher is kept first; protected slots hold
        ``select.MUST_KEEP``, padding ``select.NEVER_KEEP``.
    held_quantized
        Slots already held in the tier (broadcasts against ``priority``).
    full, quantized
        ``K`` and ``Q``.
    width
        Columns of ``TierSplit.quantized``, at least the largest count (host-known: the caller knows it
        for every layer at once); ``None`` reads it from the device.

    Taking tokens in priority order (ties: the higher slot, i.e. the newer token, first, the rule of
    :func:`reasonkv.policies.select.top_indices`), the full tier gets the first ``K`` tokens not yet in
    the tier and the tier the next ``Q`` of the others. For a sampling policy the priority is one
    Gumbel-perturbed draw, so the order is a sample without replacement: the first ``K``
    full-precision tokens are what the policy alone would keep at budget ``K`` (at the first eviction
    exactly), and the tiers together hold a sample of ``K + Q``. Too many protected tokens, or too few
    at full precision, raise ``ValueError`` (inside :func:`reasonkv.policies.select.checks_at_exit`
    when it ends, with every other check of the block in one host read).
    """
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
    """Nominal bytes of one quantized token in one (layer, kv-head): the codes of its key and value,
    its value groups' scales and zero points, its share of a full key group's (``group_size``
    tokens), and its key-group id. What a tier really holds is more: its pending tokens are at full
    precision, and key groups left with fewer members take more per member (see
    :meth:`~reasonkv.cache.quantized_tier.QuantizedTier.row_bytes`)."""
    codes = 2 * head_dim * fmt.bits / 8
    value_stats = 2 * (head_dim // fmt.group_size) * dtype_size
    key_stats = 2 * head_dim * dtype_size / fmt.group_size
    return codes + value_stats + key_stats + GROUP_ID_BYTES


def equivalent_budget(budget: int, quantized: int, fmt: QuantFormat, head_dim: int, dtype_size: int) -> float:
    """The full-precision budget with the same nominal K/V bytes as ``budget`` + ``quantized`` tokens."""
    return budget + quantized * quantized_token_bytes(head_dim, dtype_size, fmt) / full_token_bytes(
        head_dim, dtype_size
    )


def budget_for_bytes(budget: int, quantized: int, fmt: QuantFormat, head_dim: int, dtype_size: int) -> int:
    """The full-precision budget that, beside ``quantized`` quantized tokens, holds at most the nominal
    K/V bytes of ``budget`` full-precision tokens."""
    share = quantized * quantized_token_bytes(head_dim, dtype_size, fmt) / full_token_bytes(head_dim, dtype_size)
    return budget - math.ceil(share - 1e-9)
