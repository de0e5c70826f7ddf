"""One evicting layer's storage: dense K/V and the logical position of every slot.

``keys``/``values`` are ``[batch, kv_heads, slots, head_dim]``, ``positions`` ``[batch, kv_heads, slots]``
(``-1`` for padding). What the layers share (which slots are real, the positions of the forward in
progress, the capacity rule) is the cache's :class:`~reasonkv.cache.rows.RowState`, handed to each
layer; with a quantized tier the layer also holds its :class:`~reasonkv.cache.tiers.QuantizedTier`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from reasonkv.cache.quantize import QuantFormat
from reasonkv.cache.rows import RowState
from reasonkv.cache.tiers import QuantizedTier

__all__ = ["EvictingLayer", "take_slots"]


class EvictingLayer(CacheLayerMixin):
    """A full-attention layer of an evicting cache.

    Parameters
    ----------
    rows
        The row state every evicting layer of the cache shares.
    unannounced
        Called with ``q`` when a forward writes without having been announced (no evictor attached):
        raises if the cache must evict, or announces the tokens as all real.
    tier_format
        The quantized tier's format for a head_dim (None: the cache has no tier).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        rows: RowState,
        unannounced: Callable[[int, int, torch.device], None],
        tier_format: Callable[[int], QuantFormat] | None = None,
    ):
        super().__init__()
        self.rows, self.unannounced, self.tier_format = rows, unannounced, tier_format
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
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def resize(self, capacity: int) -> None:
        """Reallocate the buffers to ``capacity`` slots, keeping the first ``length``."""
        n = self.length
        k, v, p = self._keys, self._values, self._positions
        self._keys = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
        self._values = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
        self._positions = p.new_full((*p.shape[:2], capacity), -1)
        self._keys[:, :, :n] = k[:, :, :n]
        self._values[:, :, :n] = v[:, :, :n]
        self._positions[:, :, :n] = p[:, :, :n]
        self._refresh_views()

    def _refresh_views(self) -> None:
        n = self.length
        self.keys = self._keys[:, :, :n]
        self.values = self._values[:, :, :n]
        self.positions = self._positions[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, q, _ = key_states.shape
        if self.rows.opens_step(self.length):  # the first layer of a new forward pass opens the step
            if not self.rows.expects(q):
                self.unannounced(batch, q, key_states.device)
            self.rows.open_step(q)
        self.write(key_states, value_states, self.rows.step_positions)
        return self.attended()

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        start, q = self.length, key_states.shape[2]
        if start + q > self.capacity:
            self.resize(self.rows.capacity_for(start + q, self.capacity))
        self._keys[:, :, start : start + q] = key_states
        self._values[:, :, start : start + q] = value_states
        self._positions[:, :, start : start + q] = positions.unsqueeze(1)
        self.length = start + q
        self._refresh_views()

    def gather(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep slots ``index`` ``[batch, heads, new_slots]``; where ``valid`` is False, padding."""
        n = index.shape[-1]
        keys, values = take_slots(self._keys, index), take_slots(self._values, index)
        positions = self.positions.gather(2, index).masked_fill(~valid.unsqueeze(1), -1)
        self._keys[:, :, :n] = keys
        self._values[:, :, :n] = values
        self._positions[:, :, :n] = positions
        self.length = n
        self._refresh_views()

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as attention sees them: the quantized tier dequantized, then the full tier."""
        if self.quantized is None or self.quantized.width == 0:
            return self.keys, self.values
        keys, values = self.quantized.dequantize()
        return torch.cat([keys, self.keys], dim=2), torch.cat([values, self.values], dim=2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.slots + query_length, 0

    def get_seq_length(self) -> int:
        return self.rows.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.rows, self.unannounced, self.tier_format)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictingCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingCache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingCache does not support expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("EvictingCache does not support selecting batch rows")


def take_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, h, index[b, h, i]]`` as ``[batch, heads, n, dim]``: whole head_dim rows picked by one
    ``index_select`` over the flattened slots, many times faster than an element-wise ``gather``."""
    batch, heads, capacity, dim = buffer.shape
    first_slot = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * capacity
    rows = buffer.reshape(batch * heads * capacity, dim).index_select(0, (first_slot + index).flatten())
    return rows.view(batch, heads, index.shape[-1], dim)
