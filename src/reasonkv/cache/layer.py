"""One evicting layer's storage: dense K/V and the logical position of every slot.

``keys``/``values`` ``[batch, kv_heads, slots, head_dim]`` and ``positions`` ``[batch, kv_heads, slots]`` (``-1``:
padding) are views of buffers of ``capacity`` slots from buffer slot ``start``; what the layers share is the
cache's :class:`~reasonkv.cache.rows.RowState`. An eviction rewrites only its rows: when the others leave
slots at the left unused, ``start`` moves past them, and every row moves only when a write would pass the end."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from reasonkv.cache.quantize import QuantFormat
from reasonkv.cache.quantized_tier import DequantizeBuffer, QuantizedTier, take_slots
from reasonkv.cache.rows import RowState

__all__ = ["EvictingLayer", "put_row_slots", "take_row_slots", "take_slots"]


class EvictingLayer(CacheLayerMixin):
    """A full-attention layer of an evicting cache: ``rows`` is the state every evicting layer shares;
    ``unannounced(batch, q, device)`` is called when a forward writes unannounced (it raises if the cache must
    evict); ``tier_format`` gives the quantized tier's format for a head_dim (None: no tier); ``workspace`` is
    the buffer the layers share to assemble K/V holding quantized tokens."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        rows: RowState,
        unannounced: Callable[[int, int, torch.device], None],
        tier_format: Callable[[int], QuantFormat] | None = None,
        workspace: DequantizeBuffer | None = None,
    ):
        super().__init__()
        self.rows, self.unannounced, self.tier_format = rows, unannounced, tier_format
        self.workspace = workspace
        self.start = 0  # the buffer slot of the views' first slot
        self.length = 0  # slots written by this layer (equals rows.slots - rows.low_width between forwards)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self.quantized: QuantizedTier | None = None  # the quantized tier, when the cache has one

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch, heads, _, dim = key_states.shape
        if self.tier_format is not None:
            self.tier_format(dim)  # refuses a group size that does not divide head_dim
        self._keys = key_states.new_empty((batch, heads, 0, dim))
        self._values = value_states.new_empty((batch, heads, 0, value_states.shape[-1]))
        self._positions = torch.empty((batch, heads, 0), dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (``capacity`` slots), of which the views are a window."""
        return self._keys, self._values

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def resize(self, capacity: int) -> None:
        """Reallocate the buffers to ``capacity`` slots, the views' slots first."""
        n, a = self.length, self.start
        # Zeros, not garbage: a compiled step reads every slot, masked or not, and 0 * NaN is NaN.
        for name, fill in (("_keys", 0), ("_values", 0), ("_positions", -1)):
            old = getattr(self, name)
            new = old.new_full((*old.shape[:2], capacity, *old.shape[3:]), fill)
            new[:, :, :n] = old[:, :, a : a + n]
            setattr(self, name, new)
        self.start = 0
        self._refresh_views()

    def _to_front(self) -> None:
        """Move every row's slots to the front of the buffers (``start`` back to 0)."""
        n, a = self.length, self.start
        for buffer in (self._keys, self._values, self._positions):
            buffer[:, :, :n] = buffer[:, :, a : a + n].clone()  # the ranges may overlap
        self.start = 0
        self._refresh_views()

    def _refresh_views(self) -> None:
        a, b = self.start, self.start + self.length
        self.keys = self._keys[:, :, a:b]
        self.values = self._values[:, :, a:b]
        self.positions = self._positions[:, :, a:b]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, q, _ = key_states.shape
        if self.rows.opens_step(self.length):  # the first layer of a new forward pass opens the step
            if not self.rows.expects(q):
                self.unannounced(batch, q, key_states.device)
            self.rows.open_step(q)
        self.write(key_states, value_states, self.rows.step_positions)
        return self._assembled(self.workspace)  # read by this layer's attention before the next layer's write

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        q = key_states.shape[2]
        end = self.make_room(q)
        self._keys[:, :, end : end + q] = key_states
        self._values[:, :, end : end + q] = value_states
        self.advance(positions)

    def make_room(self, q: int) -> int:
        """Room for ``q`` more slots after the views (grown, or every row moved to the front); returns where."""
        needed = self.length + q
        if self.start + needed > self.capacity:
            wanted = self.rows.capacity_for(needed, self.capacity)
            if wanted > self.capacity:  # more rows than room, or a ragged batch's slack not allocated yet
                self.resize(wanted)
            else:
                self._to_front()
        return self.start + self.length

    def advance(self, positions: torch.Tensor) -> None:
        """The K/V of ``positions`` ``[batch, q]`` were written after the views (by :meth:`write`, or a compiled step):
        record their positions and extend the views."""
        end, q = self.start + self.length, positions.shape[1]
        self._positions[:, :, end : end + q] = positions.unsqueeze(1)
        self.length += q
        self._refresh_views()

    def read_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``[n, heads, m, head_dim]`` and positions ``[n, heads, m]`` of ``rows``' slots ``slots``
        ``[n, heads, m]`` (of the views; a slot before the view's start reads the buffers there)."""
        at = slots + self.start
        positions = self._positions.index_select(0, rows).gather(2, at)
        return take_row_slots(self._keys, rows, at), take_row_slots(self._values, rows, at), positions

    def compact_rows(
        self, rows: torch.Tensor, keep: torch.Tensor, length: int, holes: torch.Tensor | None = None
    ) -> None:
        """``rows`` ``[n]`` keep their slots ``keep`` ``[n, heads, k]``, right-aligned in views of ``length`` slots
        ending where the current ones end; other rows are untouched (their tokens must fit). ``holes``: entries
        keeping no token (an allocated head keeping fewer), whose slots get position -1."""
        end, k = self.start + self.length, keep.shape[-1]
        keys, values, positions = self.read_rows(rows, keep)
        if holes is not None:
            positions = positions.masked_fill(holes, -1)
        target = torch.arange(end - k, end, device=keep.device).expand_as(keep)
        put_row_slots(self._keys, rows, target, keys)
        put_row_slots(self._values, rows, target, values)
        padding = positions.new_full((*positions.shape[:2], length - k), -1)  # the rows' slots before them
        self._positions[rows, :, end - length : end] = torch.cat([padding, positions], dim=2)
        self.start, self.length = end - length, length
        self._refresh_views()

    def held_bytes(self) -> int:
        """Bytes of the full-precision K/V in the views (the slots in use, padding included)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as attention sees them (the tier dequantized first): views, or new tensors with a tier."""
        return self._assembled(None)

    def _assembled(self, workspace: DequantizeBuffer | None) -> tuple[torch.Tensor, torch.Tensor]:
        tier = self.quantized
        if tier is None or tier.width == 0:
            return self.keys, self.values
        width, (batch, heads, n, dim) = tier.width, self.keys.shape
        shape = (batch, heads, width + n, dim)
        if workspace is None:
            keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
        else:
            keys, values = workspace.take(shape, self.keys.dtype, self.keys.device, reserve=width + self.capacity)
        tier.dequantize_into(keys[:, :, :width], values[:, :, :width])
        keys[:, :, width:].copy_(self.keys)
        values[:, :, width:].copy_(self.values)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.slots + query_length, 0

    def get_seq_length(self) -> int:
        return self.rows.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.rows, self.unannounced, self.tier_format, self.workspace)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictingCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingCache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingCache does not support expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("EvictingCache does not support selecting batch rows")


def _row_slot_index(buffer: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Flat indices of ``buffer[rows[i], h, slots[i, h, j]]`` into ``buffer`` viewed as ``[-1, ...]``."""
    heads, capacity = buffer.shape[1], buffer.shape[2]
    first = (rows.view(-1, 1, 1) * heads + torch.arange(heads, device=slots.device).view(1, -1, 1)) * capacity
    return (first + slots).flatten()


def take_row_slots(buffer: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer[rows[i], h, slots[i, h, j]]`` as ``[n, heads, m, dim]``, reading only the named rows."""
    dim = buffer.shape[3]
    picked = buffer.view(-1, dim).index_select(0, _row_slot_index(buffer, rows, slots))
    return picked.view(*slots.shape, dim)


def put_row_slots(buffer: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[rows[i], h, slots[i, h, j]] = values[i, h, j]``, in place, writing only the named rows."""
    dim = buffer.shape[3]
    buffer.view(-1, dim).index_copy_(0, _row_slot_index(buffer, rows, slots), values.reshape(-1, dim))
