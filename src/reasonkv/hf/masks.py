"""Attention masks for a hybrid model under ``EvictingCache``: one mask per layer type.

Full-attention layers hold the cache's slots, sliding-window layers the model's own sliding cache,
so the two see different keys and need different masks. transformers models with ``layer_types``
take a mapping ``{layer type: mask}`` as their ``attention_mask`` and use it as it is; this module
builds that mapping with transformers' own mask functions, so every attention implementation
(SDPA, eager, FlashAttention, flex) gets the mask in the form it expects:

- full attention: the causal mask over the slots, from the cache's 2-D slot mask (what a plain model
  gets from that 2-D mask directly);
- sliding window: transformers' sliding-window causal mask over the tokens the sliding layers hold,
  from their own 2-D padding mask. Those layers store the most recent tokens in order, padding
  included, exactly as without reasonkv, so the window the mask function applies is the model's own
  window over logical positions;
- linear attention: the padding mask of the incoming tokens, as the model makes it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import masking_utils

from reasonkv.hf.model import layer_kinds, text_config

__all__ = ["LayerMasks"]


class LayerMasks:
    """Builds the per-layer-type attention masks of ``model`` for the forwards that use ``cache``.

    ``cache`` is an ``EvictingCache`` holding sliding-window layers: it provides the sliding layers'
    padding mask (``window.mask()``, for the announced forward) and, through ``get_mask_sizes`` /
    ``get_query_offset``, the sizes and offsets of each layer kind.
    """

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
