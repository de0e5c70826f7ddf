"""Attention masks for a hybrid model under ``EvictingCache``: one mask per layer type.

Full-attention layers hold the cache's slots, sliding-window layers the model's own sliding cache, so they
see different keys. Models with ``layer_types`` take ``{layer type: mask}`` as their ``attention_mask``; this
module builds it with transformers' own mask functions, so every attention implementation gets its form:
the causal mask over the slots (full), the model's sliding-window mask over what the sliding layers hold
(they store the newest tokens in order, padding included, as without reasonkv), and the incoming tokens'
padding mask (linear)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import masking_utils

from reasonkv.hf.model import layer_kinds, text_config

__all__ = ["LayerMasks"]


class LayerMasks:
    """Builds the per-layer-type attention masks of ``model`` for the forwards that use ``cache``, an
    ``EvictingCache`` holding sliding-window layers (its ``window.mask()``, ``get_mask_sizes`` and
    ``get_query_offset`` give each kind's padding, sizes and offsets)."""

    def __init__(self, model: torch.nn.Module, cache: Any):
        self.config = text_config(model)
        self._cache = weakref.ref(cache)  # weakly: the cache's evictor owns these masks
        self.dtype = next(model.parameters()).dtype
        kinds = layer_kinds(self.config)
        self.first: dict[str, tuple[int, str]] = {}  # transformers layer type -> (its first layer, kind)
        for index, (name, kind) in enumerate(zip(self.config.layer_types, kinds, strict=True)):
            self.first.setdefault(name, (index, kind))
        self._causal = masking_utils.create_causal_mask
        self._sliding = masking_utils.create_sliding_window_causal_mask
        self._recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)

    @property
    def cache(self) -> Any:
        return self._cache()

    def __call__(
        self, batch: int, q: int, slot_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> dict[str, Any]:
        """The masks of the next forward (``q`` tokens per row, already announced to the cache), whose
        full-attention layers see ``slot_mask`` (the cache's 2-D slot mask; None: no padding)."""
        device = position_ids.device
        # Mask functions read only the shape, device and dtype of the embeddings.
        embeds = torch.empty((batch, q, 0), dtype=self.dtype, device=device)
        window_mask = self.cache.window.mask()
        masks: dict[str, Any] = {}
        for name, (index, kind) in self.first.items():
            if kind == "full":
                masks[name] = self._causal(self.config, embeds, slot_mask, self.cache, position_ids, layer_idx=index)
            elif kind == "sliding":
                masks[name] = self._sliding(self.config, embeds, window_mask, self.cache, position_ids, layer_idx=index)
            elif self._recurrent is not None:
                incoming = None if slot_mask is None else slot_mask[:, -q:].long()
                masks[name] = self._recurrent(self.config, embeds, incoming, self.cache)
            else:
                masks[name] = None
        return masks
