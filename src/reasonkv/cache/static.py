"""The evicting cache at a fixed shape: what a compiled decode step reads and writes.

An evicting layer's views change width at every step, so :class:`StaticLayout` hands a compiled step the
whole buffers (``capacity`` slots, allocated once per run): the new token goes to one buffer slot (a device
tensor) and attention reads every slot through a ``[batch, 1, 1, capacity]`` mask of the real ones.
Whatever moves slots (the gather, moving rows to the front) runs between steps, in place. Hybrid models,
quantized tiers and allocations have no such layout (:func:`static_blocker`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reasonkv.cache.layer import EvictingLayer
from reasonkv.cache.storage import KVStorage

__all__ = ["StaticLayout", "static_blocker"]


def static_blocker(storage: KVStorage) -> str | None:
    """Why ``storage`` cannot be read at a fixed shape (None: it can)."""
    if storage.quantized:
        return f"a quantized tier (quantized={storage.quantized}) changes shape as it fills"
    if len(storage.full_layers) != len(storage.layers):
        return "the model's sliding-window or linear-attention layers keep caches that change shape"
    if getattr(storage, "allocated", False):
        return "an allocation gives each kv-head its own mask through the kernel reader (a compiled step calls none)"
    return None


class _FixedLayer(CacheLayerMixin):
    """One evicting layer's whole buffers: ``update`` writes the new token at buffer slot ``column`` and
    returns every slot (the mask hides those without a real token)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a fixed layer is built on its buffers")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # positions and the mask are given to the step; nothing derives them from this

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticLayout:
    """``storage`` seen at a fixed shape, one decode step at a time: :meth:`open_step` makes room for the token
    and returns the ``Cache`` over the whole buffers and the mask, :meth:`close_step` records its positions.
    Both objects stay the same from step to step (rebuilt only when buffers are reallocated), so a compiled
    step is not traced again."""

    def __init__(self, storage: KVStorage):
        blocker = static_blocker(storage)
        if blocker is not None:
            raise ValueError(f"this cache has no fixed-shape layout: {blocker}")
        self.storage = storage
        self.layers: list[EvictingLayer] = [storage.layers[i] for i in storage.full_layers]
        self._buffers: list[torch.Tensor] = []  # each layer's key buffer the view was built on
        self.view: Cache | None = None
        self.mask: torch.Tensor | None = None  # [batch, 1, 1, capacity] bool
        self.column: torch.Tensor | None = None  # [1] long: the buffer slot the step writes

    def open_step(self) -> tuple[Cache, torch.Tensor]:
        """Room for one token in every layer; the cache the step runs with and its mask."""
        rows = self.storage.rows
        rows.open_step(1)
        columns = {layer.make_room(1) for layer in self.layers}
        starts = {layer.start for layer in self.layers}
        if len(columns) != 1 or len(starts) != 1:  # every layer moves its slots alike
            raise RuntimeError(f"evicting layers disagree on where the next token goes: {sorted(columns)}")
        current = [layer.buffers[0] for layer in self.layers]
        if len(current) != len(self._buffers) or any(a is not b for a, b in zip(current, self._buffers, strict=True)):
            self._rebuild(rows.buffer.shape[0])
        (column,), (start,) = columns, starts
        self.column.fill_(column)
        self.mask.zero_()
        self.mask[:, 0, 0, start : column + 1] = rows.valid
        return self.view, self.mask

    def close_step(self, step_positions: torch.Tensor) -> None:
        """The step wrote its token's K/V: record their positions ``[batch, 1]``."""
        for layer in self.layers:
            layer.advance(step_positions)

    def _rebuild(self, batch: int) -> None:
        first = self.layers[0]
        device = first.buffers[0].device
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, 1, 1, first.capacity), dtype=torch.bool, device=device)
        self._buffers = [layer.buffers[0] for layer in self.layers]
        for buffer in (self.column, self.mask, *(b for layer in self.layers for b in layer.buffers)):
            if device.type == "cuda":  # CUDA graphs replay on these addresses instead of copying them in
                torch._dynamo.mark_static_address(buffer)
        self.view = Cache(layers=[_FixedLayer(*layer.buffers, self.column) for layer in self.layers])
