"""The quantized tier: "keep, but in fewer bytes", between keeping a token and evicting it (torch only).

With a quantized budget ``Q``, every eviction splits the tokens of each head three ways by the
policy's ranking (:meth:`reasonkv.policies.Policy.ranking`, the order its ``keep`` takes tokens in):

- the first ``K`` still held at full precision stay at full precision (protected tokens and, for
  VASE, the value-range reservation rank first, so they are among them whenever ``K`` holds them);
- the next ``Q`` (counting the tokens already quantized) are kept quantized; a full-precision token
  among them is quantized now;
- the rest are dropped.

A quantized token is never promoted back: it competes at every eviction for the ``Q`` low slots
only, and once dropped it is gone. Its codes are fixed when it is quantized and never refitted, so
the K/V the model sees for it never change while it is held. :func:`split_tiers` makes the split,
:class:`QuantizedTier` holds one layer's quantized tokens (the formats are :mod:`reasonkv.cache.quantize`).

Key groups: the tokens a head's tier receives at one eviction are grouped by position, up to
``group_size`` per group, and each group gets a scale and zero point per channel. Dropping a member
later does not refit the group: its statistics stay as long as one member is held.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from reasonkv.cache.quantize import (
    QuantFormat,
    dequantize_channels,
    dequantize_tokens,
    quantize_channels,
    quantize_tokens,
)
from reasonkv.policies.select import MUST_KEEP, NEVER_KEEP, rank_order

__all__ = [
    "QuantizedTier",
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
    if isinstance(quantized, bool) or not isinstance(quantized, int) or quantized < 0:
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


def split_tiers(priority: torch.Tensor, held_quantized: torch.Tensor, *, full: int, quantized: int) -> TierSplit:
    """Split the slots of each leading index into full precision, quantized and dropped.

    Parameters
    ----------
    priority
        ``[..., S]`` from :meth:`Policy.ranking`: higher is kept first; protected slots hold
        ``select.MUST_KEEP``, padding ``select.NEVER_KEEP``.
    held_quantized
        Slots already held quantized (broadcasts against ``priority``).
    full, quantized
        ``K`` and ``Q``.

    Taking tokens in priority order (ties: the higher slot, i.e. the newer token, first, the rule of
    :func:`reasonkv.policies.select.top_indices`), the full
    tier gets the first ``K`` tokens not yet quantized and the quantized tier the next ``Q`` of the
    others. For a sampling policy the priority is one Gumbel-perturbed draw, so the order is a
    sample without replacement: the first ``K`` full-precision tokens are what the policy alone
    would keep at budget ``K`` (at the first eviction exactly), and the tiers together hold a
    sample of ``K + Q``.
    """
    held = torch.broadcast_to(held_quantized, priority.shape)
    order = rank_order(priority)
    ranked = priority.gather(-1, order)
    real = ranked > NEVER_KEEP
    protected = int((ranked >= MUST_KEEP).sum(-1).max()) if ranked.numel() else 0
    if protected > full + quantized:
        raise ValueError(
            f"{protected} protected tokens exceed the budget K + Q = {full} + {quantized}: lower sinks/window, "
            "turn off protect_prompt, or raise the budget or the quantized tier"
        )
    candidate = real & ~held.gather(-1, order)
    if ranked.numel() and int(candidate.sum(-1).min()) < full:
        raise ValueError(
            f"cannot keep {full} full-precision tokens from a row holding only {int(candidate.sum(-1).min())}"
        )
    to_full = candidate & (candidate.cumsum(-1) <= full)
    rest = real & ~to_full
    to_low = rest & (rest.cumsum(-1) <= quantized)
    slots = priority.shape[-1]
    kept_full = torch.where(to_full, order, slots).sort(dim=-1).values[..., :full]
    counts = to_low.sum(-1)
    width = int(counts.max()) if counts.numel() else 0
    kept_low = torch.where(to_low, order, -1).sort(dim=-1).values[..., slots - width :]
    return TierSplit(kept_full, kept_low, counts)


# ------------------------------------------------------------------------------------------ bytes


def full_token_bytes(head_dim: int, dtype_size: int) -> int:
    """Bytes of one full-precision token in one (layer, kv-head): its key and value."""
    return 2 * head_dim * dtype_size


def quantized_token_bytes(head_dim: int, dtype_size: int, fmt: QuantFormat) -> float:
    """Nominal bytes of one quantized token in one (layer, kv-head): the codes of its key and value,
    its value groups' scales and zero points, its share of a full key group's (``group_size``
    tokens), and its key-group id. Key groups left with fewer members take more (see
    :meth:`QuantizedTier.nbytes` for what is actually held)."""
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


# ------------------------------------------------------------------------------------------ storage


def _take(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, h, index[b, h, i]]``: ``[batch, heads, n, *rest]`` by ``[batch, heads, m]`` ->
    ``[batch, heads, m, *rest]`` (one ``index_select`` over the flattened slots)."""
    batch, heads, n = buffer.shape[:3]
    rest = buffer.shape[3:]
    first = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * n
    rows = buffer.reshape(batch * heads * n, *rest).index_select(0, (first + index).flatten())
    return rows.view(batch, heads, index.shape[-1], *rest)


def _id_dtype(groups: int) -> torch.dtype:
    return torch.int16 if groups < 2**15 else torch.int32


class QuantizedTier:
    """One layer's quantized tokens, ``[batch, kv_heads, width]`` slots.

    Slots are laid out like the cache's: each row's tokens right-aligned (padding first, ``-1`` in
    ``positions``), in the order of their slots when they were quantized. Per slot: packed key and
    value codes, the id of the key's group (``key_group``) and the value's statistics; per (row,
    head, key group): the key statistics.
    """

    def __init__(
        self,
        fmt: QuantFormat,
        key_codes: torch.Tensor,  # [b, h, w, d or d/2] uint8
        key_group: torch.Tensor,  # [b, h, w] int16/int32
        key_stats: torch.Tensor,  # [b, h, groups, 2, d]
        value_codes: torch.Tensor,  # [b, h, w, d or d/2] uint8
        value_stats: torch.Tensor,  # [b, h, w, 2, d/G]
        positions: torch.Tensor,  # [b, h, w] long
    ):
        self.fmt = fmt
        self.key_codes, self.key_group, self.key_stats = key_codes, key_group, key_stats
        self.value_codes, self.value_stats, self.positions = value_codes, value_stats, positions

    @classmethod
    def empty(cls, fmt: QuantFormat, like: torch.Tensor) -> QuantizedTier:
        """A tier of width 0 for K/V shaped like ``like`` ``[batch, kv_heads, slots, head_dim]``."""
        batch, heads, _, dim = like.shape
        fmt.check_head_dim(dim)
        packed = dim * fmt.bits // 8
        codes = torch.zeros((batch, heads, 0, packed), dtype=torch.uint8, device=like.device)
        return cls(
            fmt,
            key_codes=codes,
            key_group=torch.zeros((batch, heads, 0), dtype=torch.int16, device=like.device),
            key_stats=like.new_zeros((batch, heads, 0, 2, dim)),
            value_codes=codes.clone(),
            value_stats=like.new_zeros((batch, heads, 0, 2, dim // fmt.group_size)),
            positions=torch.zeros((batch, heads, 0), dtype=torch.long, device=like.device),
        )

    @property
    def width(self) -> int:
        return self.positions.shape[2]

    def nbytes(self) -> int:
        """Bytes held: codes, group ids and statistics (positions are bookkeeping, as for the full tier)."""
        parts = (self.key_codes, self.key_group, self.key_stats, self.value_codes, self.value_stats)
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, width, head_dim]`` in the K/V dtype."""
        dtype = self.key_stats.dtype
        key_stats = _take(self.key_stats, self.key_group.long())  # [b, h, w, 2, d]
        keys = dequantize_channels(self.key_codes, key_stats, self.fmt, dtype)
        values = dequantize_tokens(self.value_codes, self.value_stats, self.fmt, dtype)
        return keys, values

    def rebuild(
        self, select: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> QuantizedTier:
        """The tier holding the tokens ``select`` names, ``[batch, kv_heads, width']``.

        ``select`` indexes the slots ``[this tier | the full tier]`` (``-1``: padding); ``keys``,
        ``values`` ``[batch, kv_heads, slots, head_dim]`` and ``positions`` are the full tier's.
        Tokens already quantized keep their codes (their key groups are renumbered, and groups no
        member of which is kept are released); full-precision ones are quantized now, their keys in
        new groups of up to ``group_size`` tokens taken in slot order.
        """
        fmt, width = self.fmt, self.width
        source = self if width else self._one_empty_slot()  # so that every gather has a slot to read
        old = (select >= 0) & (select < width)
        new = select >= width
        at_old = torch.where(old, select, 0)
        at_new = torch.where(new, select - width, 0)

        # Tokens quantized now: values per token; keys per channel, in fresh groups of up to G tokens.
        batch, heads, new_width = select.shape
        value_codes, value_stats = quantize_tokens(_take(values, at_new), fmt)
        fresh_groups = (new.sum(-1) + fmt.group_size - 1) // fmt.group_size  # [b, h]
        n_fresh = int(fresh_groups.max())
        local = torch.where(new, (new.long().cumsum(-1) - 1) // fmt.group_size, n_fresh)
        fresh_keys = _take(keys, at_new).flatten(0, 1)
        key_codes, fresh_stats = quantize_channels(fresh_keys, local.flatten(0, 1), n_fresh, fmt)
        key_codes = key_codes.unflatten(0, (batch, heads))
        fresh_stats = fresh_stats.unflatten(0, (batch, heads))

        # Tokens kept quantized: their key groups, live ones compacted to the front of the table.
        groups = source.key_stats.shape[2]
        old_group = torch.where(old, source.key_group.long().gather(2, at_old), groups)  # `groups`: none
        used = torch.zeros((batch, heads, groups + 1), dtype=torch.bool, device=select.device)
        used = used.scatter_(2, old_group, True)[..., :groups]
        live = used.sum(-1, keepdim=True)  # [b, h, 1]
        renumbered = (used.long().cumsum(-1) - 1).gather(2, old_group.clamp(max=groups - 1))
        compacted = _take(source.key_stats, torch.sort(~used, dim=-1, stable=True).indices)

        # The new table: the live old groups, then the fresh ones.
        table = max(1, int((live.squeeze(-1) + fresh_groups).max()))
        slot = torch.arange(table, device=select.device)
        rows = torch.where(slot < live, slot, groups + slot - live).clamp(max=groups + n_fresh - 1)
        key_stats = _take(torch.cat([compacted, fresh_stats], dim=2), rows)
        key_group = torch.where(old, renumbered, live + local).masked_fill(select < 0, 0)

        def keep_or(fresh: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
            return torch.where(old.view(*old.shape, *[1] * (fresh.dim() - 3)), _take(kept, at_old), fresh)

        held = torch.where(old, source.positions.gather(2, at_old), positions.gather(2, at_new))
        return QuantizedTier(
            fmt,
            key_codes=keep_or(key_codes, source.key_codes),
            key_group=key_group.to(_id_dtype(table)),
            key_stats=key_stats,
            value_codes=keep_or(value_codes, source.value_codes),
            value_stats=keep_or(value_stats, source.value_stats),
            positions=held.masked_fill(select < 0, -1),
        )

    def _one_empty_slot(self) -> QuantizedTier:
        """This (empty) tier with one blank slot and one blank key group."""

        def grown(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((*t.shape[:2], 1, *t.shape[3:]), dtype=t.dtype, device=t.device)

        return QuantizedTier(
            self.fmt,
            *(grown(t) for t in (self.key_codes, self.key_group, self.key_stats, self.value_codes, self.value_stats)),
            positions=grown(self.positions) - 1,
        )
