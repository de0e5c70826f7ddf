"""One layer's quantized tier: packed codes, key groups, the pending group, and its K/V for attention (torch only).

:func:`reasonkv.cache.tiers.split_tiers` decides which tokens the tier holds; this module stores them, per
(row, kv-head) as ``[padding | coded | pending]`` (docs/quantized-tier.md):

**coded** tokens hold int8 or int4 codes (values per token, keys per channel over a *key group* of
``group_size`` tokens, KIVI), fixed while held; a group's statistics stay while one member is held.
**pending** tokens wait at full precision until ``group_size`` of them form a whole group (KIVI's residual).
Every head of a row holds as many tier tokens, but may split them differently between the two.
An eviction updates only its rows (:meth:`QuantizedTier.plan`, one host read, :meth:`QuantizedTier.apply`);
attention gets the tier dequantized into a buffer the cache's layers share (:class:`DequantizeBuffer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import torch

from reasonkv.cache.quantize import QuantFormat, quantize_channels, quantize_tokens, unpack

__all__ = ["DequantizeBuffer", "QuantizedTier", "TierUpdate", "take_slots"]

# take_full(slots [n, heads, m]) -> keys, values [n, heads, m, head_dim] and positions [n, heads, m] of the
# evicted rows' full-precision slots (slots index the full tier's view).
FullTake = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def take_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, h, index[b, h, i]]``: ``[batch, heads, n, *rest]`` by ``[batch, heads, m]`` ->
    ``[batch, heads, m, *rest]``: one ``index_select`` over the flattened slots, many times faster than an
    element-wise ``gather``."""
    batch, heads, n = buffer.shape[:3]
    rest = buffer.shape[3:]
    first = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * n
    rows = buffer.reshape(batch * heads * n, *rest).index_select(0, (first + index).flatten())
    return rows.view(batch, heads, index.shape[-1], *rest)


def _id_dtype(groups: int) -> torch.dtype:
    return torch.int16 if groups < 2**15 else torch.int32


def _aligned(tensor: torch.Tensor, width: int, fill: float | int = 0) -> torch.Tensor:
    """``tensor`` ``[b, h, w, ...]`` right-aligned to ``width`` slots: cut on the left, or padded with ``fill``."""
    w = tensor.shape[2]
    if w >= width:
        return tensor[:, :, w - width :].contiguous()
    padding = tensor.new_full((*tensor.shape[:2], width - w, *tensor.shape[3:]), fill)
    return torch.cat([padding, tensor], dim=2)


def _widened(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """A key-group table ``[b, h, T, 2, d]`` with ``groups`` entries (extra ones zero, at the end)."""
    extra = groups - tensor.shape[2]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((*tensor.shape[:2], extra, *tensor.shape[3:]))], dim=2)


class DequantizeBuffer:
    """The K/V a layer with quantized tokens hands its attention, in one buffer pair every layer of a cache shares
    (a layer's attention reads it before the next writes it), grown when needed and kept: no allocation per step."""

    def __init__(self):
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, reserve: int = 0):
        """Views ``shape`` ``[batch, heads, slots, head_dim]`` of the buffers in ``dtype`` on ``device``; a buffer that
        must grow is sized for ``reserve`` slots."""
        batch, heads, slots, dim = shape
        numel = batch * heads * slots * dim
        held = self._keys
        if held is None or held.numel() < numel or held.dtype != dtype or held.device != device:
            size = batch * heads * max(slots, reserve) * dim
            self._keys = torch.empty(size, dtype=dtype, device=device)
            self._values = torch.empty(size, dtype=dtype, device=device)
        return self._keys[:numel].view(shape), self._values[:numel].view(shape)

    def nbytes(self) -> int:
        return 0 if self._keys is None else 2 * self._keys.numel() * self._keys.element_size()


# A tier's tensors, every one with a row per batch row (what an eviction replaces for its rows).
_FIELDS = (
    "key_codes",
    "key_group",
    "key_stats",
    "value_codes",
    "value_stats",
    "positions",
    "pending_keys",
    "pending_values",
    "pending_count",
)


@dataclass
class TierUpdate:
    """What one eviction changes in one layer's tier, for its rows: their new tensors by name (:data:`_FIELDS`;
    ``key_stats`` ``[n, h, live + fresh, 2, d]``, the live old groups, then the fresh ones) and ``needed``
    ``[n, heads]``: key groups held after."""

    rows: torch.Tensor
    fields: dict[str, torch.Tensor]
    needed: torch.Tensor


@dataclass(eq=False)
class QuantizedTier:
    """One layer's quantized tier, ``[batch, kv_heads, width]`` slots (see the module docstring): per slot the
    packed codes, the key's group id, the value's statistics and the position (``-1``: padding); per key group
    its statistics ``[2, head_dim]`` (scale, zero point); per (row, head) ``pending_count``, and the pending
    tokens' K/V aligned with the last slots."""

    fmt: QuantFormat
    _: KW_ONLY
    key_codes: torch.Tensor  # [b, h, w, d or d/2] uint8
    key_group: torch.Tensor  # [b, h, w] int16/int32
    key_stats: torch.Tensor  # [b, h, groups, 2, d]
    value_codes: torch.Tensor  # [b, h, w, d or d/2] uint8
    value_stats: torch.Tensor  # [b, h, w, 2, d/G]
    positions: torch.Tensor  # [b, h, w] long
    pending_keys: torch.Tensor  # [b, h, p, d]
    pending_values: torch.Tensor  # [b, h, p, d]
    pending_count: torch.Tensor  # [b, h] long

    @classmethod
    def empty(cls, fmt: QuantFormat, like: torch.Tensor) -> QuantizedTier:
        """A tier of width 0 for K/V shaped like ``like`` ``[batch, kv_heads, slots, head_dim]``."""
        batch, heads, _, dim = like.shape
        fmt.check_head_dim(dim)
        packed = dim * fmt.bits // 8
        device = like.device
        codes = torch.zeros((batch, heads, 0, packed), dtype=torch.uint8, device=device)
        return cls(
            fmt,
            key_codes=codes,
            key_group=torch.zeros((batch, heads, 0), dtype=torch.int16, device=device),
            key_stats=like.new_zeros((batch, heads, 0, 2, dim)),
            value_codes=codes.clone(),
            value_stats=like.new_zeros((batch, heads, 0, 2, dim // fmt.group_size)),
            positions=torch.zeros((batch, heads, 0), dtype=torch.long, device=device),
            pending_keys=like.new_zeros((batch, heads, 0, dim)),
            pending_values=like.new_zeros((batch, heads, 0, dim)),
            pending_count=torch.zeros((batch, heads), dtype=torch.long, device=device),
        )

    # ------------------------------------------------------------------ shape and bytes
    @property
    def width(self) -> int:
        return self.positions.shape[2]

    @property
    def pending_width(self) -> int:
        return self.pending_keys.shape[2]

    @property
    def groups(self) -> int:
        """Entries of the key-group table (per row and head)."""
        return self.key_stats.shape[2]

    def nbytes(self) -> int:
        """Bytes allocated: codes, group ids, statistics and pending K/V (positions are bookkeeping)."""
        parts = [getattr(self, name) for name in _FIELDS if name not in ("positions", "pending_count")]
        return sum(t.numel() * t.element_size() for t in parts)

    def coded_mask(self) -> torch.Tensor:
        """``[batch, kv_heads, width]``: slots holding a coded token (not padding, not pending)."""
        slot = torch.arange(self.width, device=self.positions.device)
        return (self.positions >= 0) & (slot < self.width - self.pending_count.unsqueeze(-1))

    def row_bytes(self) -> torch.Tensor:
        """``[batch]``: the bytes each row's tokens need, over heads: per coded token its codes, group id and value
        statistics, per key group still holding a member its statistics, per pending token its K/V (:meth:`nbytes`
        counts padding and unused table entries too)."""
        batch, heads, width = self.positions.shape
        coded = self.coded_mask()
        codes = self.key_codes.shape[-1] + self.value_codes.shape[-1]  # uint8
        value_stats = self.value_stats.shape[-1] * 2 * self.value_stats.element_size()
        per_token = codes + self.key_group.element_size() + value_stats
        per_group = 2 * self.key_stats.shape[-1] * self.key_stats.element_size()
        groups = self.groups
        live = torch.zeros((batch, heads, groups + 1), dtype=torch.bool, device=coded.device)
        if width and groups:
            live.scatter_(2, torch.where(coded, self.key_group.long(), groups), True)
        pending = 2 * self.pending_keys.shape[-1] * self.pending_keys.element_size()
        held = coded.sum(-1) * per_token + live[..., :groups].sum(-1) * per_group + self.pending_count * pending
        return held.sum(-1)

    # ------------------------------------------------------------------ reading
    def dequantize_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the tier's K/V into ``keys`` and ``values`` (coded tokens dequantized, pending ones copied)."""
        fmt, dim = self.fmt, keys.shape[-1]
        if self.groups:  # (a tier of pending tokens only has no group yet)
            keys.copy_(unpack(self.key_codes, fmt.bits))
            index = self.key_group.long()
            keys.mul_(take_slots(self.key_stats[:, :, :, 0], index)).add_(take_slots(self.key_stats[:, :, :, 1], index))
        else:
            keys.zero_()
        grouped = values.view(*values.shape[:3], dim // fmt.group_size, fmt.group_size)
        grouped.copy_(unpack(self.value_codes, fmt.bits).view(grouped.shape))
        stats = self.value_stats.to(values.dtype)
        grouped.mul_(stats[:, :, :, 0, :, None]).add_(stats[:, :, :, 1, :, None])
        p = self.pending_width
        if p:
            slot = torch.arange(p, device=keys.device)
            pending = (slot >= p - self.pending_count.unsqueeze(-1)).unsqueeze(-1)  # [b, h, p, 1]
            tail = slice(self.width - p, self.width)
            keys[:, :, tail] = torch.where(pending, self.pending_keys.to(keys.dtype), keys[:, :, tail])
            values[:, :, tail] = torch.where(pending, self.pending_values.to(values.dtype), values[:, :, tail])

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, width, head_dim]`` in the K/V dtype (new tensors)."""
        shape = (*self.positions.shape, self.key_stats.shape[-1])
        keys = self.key_stats.new_empty(shape)
        values = self.key_stats.new_empty(shape)
        self.dequantize_into(keys, values)
        return keys, values

    # ------------------------------------------------------------------ an eviction
    def plan(self, rows: torch.Tensor, select: torch.Tensor, take_full: FullTake) -> TierUpdate:
        """The evicted ``rows``' tier after an eviction: ``select`` ``[n, kv_heads, width']`` names their tier's tokens,
        right-aligned and ascending, as slots of ``[this tier | the full tier]`` (``-1``: padding); ``take_full``
        reads their full-precision slots. Coded tokens keep their codes (groups renumbered, empty ones released);
        the others, by position, are coded now in whole ``group_size`` runs, the rest stay pending."""
        fmt, size = self.fmt, self.fmt.group_size
        width, pending_width, groups = self.width, self.pending_width, self.groups
        n, heads, new_width = select.shape
        old = {name: t.index_select(0, rows) for name, t in self._named().items()}
        real = select >= 0
        coded_end = width - old["pending_count"].unsqueeze(-1)
        old_coded = real & (select < coded_end)
        was_pending = real & (select >= coded_end) & (select < width)
        at_old = select.clamp(0, max(width - 1, 0))
        full_keys, full_values, full_positions = take_full(torch.where(select >= width, select - width, 0))
        keys, values = full_keys, full_values
        if pending_width:
            at_pending = (select - (width - pending_width)).clamp(0, pending_width - 1)
            where = was_pending.unsqueeze(-1)
            keys = torch.where(where, take_slots(old["pending_keys"], at_pending).to(keys.dtype), keys)
            values = torch.where(where, take_slots(old["pending_values"], at_pending).to(values.dtype), values)
        positions = full_positions
        if width:
            positions = torch.where(select < width, old["positions"].gather(2, at_old), positions)
        positions = positions.masked_fill(~real, -1)

        # The layout: padding, the coded tokens kept (in their order), then the others by position.
        place = torch.where(old_coded, torch.arange(new_width, device=select.device), new_width + positions)
        order = torch.where(real, place, -1).sort(dim=-1, stable=True).indices
        gather = lambda t: t.gather(2, order)  # noqa: E731
        real, old_coded, positions, at_old = map(gather, (real, old_coded, positions, at_old))
        keys, values = take_slots(keys, order), take_slots(values, order)
        others = real & ~old_coded
        rank = others.long().cumsum(-1) - 1
        count = others.sum(-1)  # [n, h]
        fresh = count // size  # whole groups coded now
        coded_now = others & (rank < (fresh * size).unsqueeze(-1))

        # Coded now: values per token, keys per channel in groups of `size` consecutive candidates.
        value_codes, value_stats = quantize_tokens(values, fmt)
        bound = new_width // size  # the most fresh groups a head can form (host-known)
        local = torch.where(coded_now, rank // size, bound)
        key_codes, fresh_stats = quantize_channels(keys.flatten(0, 1), local.flatten(0, 1), bound, fmt)
        key_codes, fresh_stats = key_codes.unflatten(0, (n, heads)), fresh_stats.unflatten(0, (n, heads))

        # Kept coded: their codes, and their groups compacted to the front of the table.
        live = torch.zeros((n, heads), dtype=torch.long, device=select.device)
        group = torch.zeros_like(select)
        stats = fresh_stats
        if width and groups:
            old_group = torch.where(old_coded, old["key_group"].long().gather(2, at_old), groups)
            used = torch.zeros((n, heads, groups + 1), dtype=torch.bool, device=select.device)
            used = used.scatter_(2, old_group, True)[..., :groups]
            live = used.sum(-1)
            renumbered = (used.long().cumsum(-1) - 1).gather(2, old_group.clamp(max=groups - 1))
            group = torch.where(old_coded, renumbered, group)
            compacted = take_slots(old["key_stats"], torch.sort(~used, dim=-1, stable=True).indices)
            # live old groups first; fresh ones from each head's own live count on
            slot = torch.arange(groups + bound, device=select.device)
            source = torch.where(slot < live.unsqueeze(-1), slot, groups + slot - live.unsqueeze(-1))
            source = source.clamp(max=groups + max(bound, 1) - 1)
            table = torch.cat([compacted, fresh_stats if bound else compacted[:, :, :1]], dim=2)
            stats = take_slots(table, source)

            def kept(fresh_part: torch.Tensor, old_part: torch.Tensor) -> torch.Tensor:
                where = old_coded.view(*old_coded.shape, *[1] * (fresh_part.dim() - 3))
                return torch.where(where, take_slots(old_part, at_old), fresh_part)

            key_codes = kept(key_codes, old["key_codes"])
            value_codes = kept(value_codes, old["value_codes"])
            value_stats = kept(value_stats, old["value_stats"])
        group = torch.where(coded_now, live.unsqueeze(-1) + local, group)

        # Pending: the last `count - fresh * size` slots of each head, in a buffer of the last slots.
        pending_count = count - fresh * size
        p = min(size - 1, new_width)
        slot = torch.arange(p, device=select.device)
        waiting = (slot >= p - pending_count.unsqueeze(-1)).unsqueeze(-1)
        pending_keys = keys[:, :, new_width - p :].masked_fill(~waiting, 0)
        pending_values = values[:, :, new_width - p :].masked_fill(~waiting, 0)
        pending = (pending_keys.to(self.pending_keys.dtype), pending_values.to(self.pending_values.dtype))
        tensors = (key_codes, group, stats, value_codes, value_stats, positions, *pending, pending_count)
        return TierUpdate(rows, dict(zip(_FIELDS, tensors, strict=True)), live + fresh)

    def apply(self, update: TierUpdate, groups: int) -> QuantizedTier:
        """This tier with ``update``'s rows replaced; ``groups`` (host-known) covers every evicted head's groups. In
        place when the shapes stay (the steady state), a new tier otherwise (other rows re-right-aligned)."""
        new = dict(update.fields)
        width, p = new["positions"].shape[2], new["pending_keys"].shape[2]
        groups = max(groups, self.groups, 1)
        same = (width, p, groups) == (self.width, self.pending_width, self.groups)
        tier = self if same else self._reshaped(width, p, groups)
        new["key_group"] = new["key_group"].to(tier.key_group.dtype if same else _id_dtype(groups))
        new["key_stats"] = _widened(new["key_stats"], groups)[:, :, :groups]
        for name, target in tier._named().items():
            target.index_copy_(0, update.rows, new[name].to(target.dtype))
        return tier

    def _named(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _FIELDS}

    def _reshaped(self, width: int, pending_width: int, groups: int) -> QuantizedTier:
        """A copy at a new width, pending width and table size, every row's slots kept right-aligned."""
        return QuantizedTier(
            self.fmt,
            key_codes=_aligned(self.key_codes, width),
            key_group=_aligned(self.key_group, width).to(_id_dtype(groups)),
            key_stats=_widened(self.key_stats, groups),
            value_codes=_aligned(self.value_codes, width),
            value_stats=_aligned(self.value_stats, width),
            positions=_aligned(self.positions, width, -1),
            pending_keys=_aligned(self.pending_keys, pending_width),
            pending_values=_aligned(self.pending_values, pending_width),
            pending_count=self.pending_count.clone(),
        )
