"""What a policy may read at eviction time: the rows being evicted, their stored K/V, positions and the
recorded signals. Torch only: a serving engine builds this view over its own storage (``layers[i].keys/values``,
``positions(i)``, ``valid``, ``next_position``, ``prompt_lengths``, ``row_evictions``, ``budget``; with a
quantized tier ``attended(i)`` and ``quantized_mask()``), dense ``[batch, kv_heads, slots, head_dim]`` per
layer, each row's tokens right-aligned in the order they came, as many in every head of a row (paged
storage gathers a row's blocks first).
"""

from __future__ import annotations

import copy

import torch

from reasonkv.policies import attention, noise, select
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.recorded import Recorded

__all__ = ["EvictionView"]


class EvictionView:
    """The evicted rows' view of the cache and the recorded signals, for one eviction.

    ``layer`` is ``None`` for token-granularity policies (one call for all layers) and the layer
    being scored for head-granularity ones. Tensors have the evicted rows as their first dimension;
    ``rows`` holds their indices, distinct and in increasing order.
    """

    def __init__(
        self,
        *,
        cache,
        recorded: Recorded,
        policy,
        rows,
        row_seeds,
        info: ModelInfo,
        layer: int | None = None,
        budget: int | None = None,
    ):
        self.cache, self.recorded, self.policy = cache, recorded, policy
        self.rows = rows
        self.row_seeds = row_seeds  # [rows] int64: the run's seed of each evicted row
        self.info = info
        self.layer = layer
        self.budget: int = cache.budget if budget is None else budget  # K: the spec's, as the evictor passes it
        self.layer_budgets: dict[int, int] | None = None  # per layer under an allocation (see at)
        self._attended: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # ``rows`` are distinct and sorted (as ``nonzero`` gives them), so as many as the batch are all of it.
        self._all_rows = rows.numel() == cache.valid.shape[0]

    def at(self, layer: int) -> EvictionView:
        """The same eviction, seen from one layer (head-granularity scoring)."""
        view = copy.copy(self)
        view.layer = layer
        if self.layer_budgets is not None:  # an allocation: the mean budget of this layer's heads
            view.budget = self.layer_budgets[layer]
        view._attended = {}  # this layer's dequantized K/V live as long as its view
        return view

    def _take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._all_rows else tensor.index_select(0, self.rows.to(tensor.device))

    def _layer(self, layer: int | None) -> int:
        layer = self.layer if layer is None else layer
        if layer is None:
            raise ValueError("this view scores all layers at once: pass a layer index")
        return layer

    # -- stored state ---------------------------------------------------------------------------
    def _stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        attended = getattr(self.cache, "attended", None)
        if attended is None:
            entry = self.cache.layers[layer]
            return entry.keys, entry.values
        if layer not in self._attended:  # dequantized once per layer and eviction; only the latest layer is
            self._attended = {layer: attended(layer)}  # kept, so reading every layer holds one at a time
        return self._attended[layer]

    def keys(self, layer: int | None = None) -> torch.Tensor:
        """``[rows, kv_heads, slots, head_dim]`` (post-RoPE keys, as stored; quantized ones dequantized)."""
        return self._take(self._stored(self._layer(layer))[0])

    def values(self, layer: int | None = None) -> torch.Tensor:
        """``[rows, kv_heads, slots, head_dim]`` (quantized ones dequantized)."""
        return self._take(self._stored(self._layer(layer))[1])

    def positions(self, layer: int | None = None) -> torch.Tensor:
        """Logical positions ``[rows, kv_heads, slots]`` (-1: padding)."""
        return self._take(self.cache.positions(self._layer(layer)))

    def token_positions(self) -> torch.Tensor:
        """``[rows, slots]`` for token-granularity policies (identical in every evicting layer and head; under an
        allocation, where heads keep nested sets of one ranking, those of each row's widest head)."""
        widest = getattr(self.cache, "widest_positions", None)
        if widest is not None and getattr(self.cache, "allocated", False):
            return self._take(widest())
        return self._take(self.cache.positions(self.info.full_layers[0])[:, 0])

    @property
    def valid(self) -> torch.Tensor:
        """``[rows, slots]``: real tokens (False: padding)."""
        return self._take(self.cache.valid)

    @property
    def seeds(self) -> torch.Tensor:
        """Seeds for this eviction's random draws, ``[rows]`` int64: the row's seed mixed with how many
        evictions the row had and the layer (see :mod:`reasonkv.policies.noise`)."""
        layer = -1 if self.layer is None else self.layer
        return noise.mix(self.row_seeds, self.evictions_so_far, layer)

    def slot_positions(self) -> torch.Tensor:
        """Logical positions shaped like this view's scores: ``[rows, slots]`` or ``[rows, kv_heads, slots]``."""
        return self.token_positions() if self.layer is None else self.positions()

    def valid_mask(self) -> torch.Tensor:
        """``valid`` shaped to broadcast against this view's scores (per head when heads hold padding of their
        own: a cache whose ``allocated`` is true)."""
        if self.layer is None:
            return self.valid
        if getattr(self.cache, "allocated", False):
            return self.valid.unsqueeze(1) & (self.positions() >= 0)
        return self.valid.unsqueeze(1)

    @property
    def newest(self) -> torch.Tensor:
        """Logical position of each row's newest token, ``[rows]``."""
        return self._take(self.cache.next_position) - 1

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self._take(self.cache.prompt_lengths)

    @property
    def evictions_so_far(self) -> torch.Tensor:
        """How many times each row was evicted before this eviction, ``[rows]``."""
        return self._take(self.cache.row_evictions)

    def quantized_mask(self) -> torch.Tensor:
        """Slots held quantized (a quantized tier's tokens), shaped to broadcast like :meth:`valid_mask`."""
        mask = getattr(self.cache, "quantized_mask", None)
        held = self._take(mask()) if mask is not None else torch.zeros_like(self.valid)
        return held if self.layer is None else held.unsqueeze(1)

    def protected(self, window: int | None = None) -> torch.Tensor:
        """Slots the policy's sinks / window / prompt protection keep, shaped like the scores (``window``: a
        recent window other than the policy's own)."""
        positions = self.slot_positions()
        p = self.policy
        return select.protected_mask(
            positions,
            sinks=p.sinks,
            window=p.window if window is None else window,
            newest=self.newest,
            prompt_lengths=self.prompt_lengths if p.protect_prompt else None,
        )

    # -- recorded signals -------------------------------------------------------------------------
    def kernel(self, layer: int | None = None) -> attention.Kernel:
        """What ``layer``'s attention kernel applies (its scaling ``1/sqrt(head_dim)`` until seen)."""
        return self.recorded.kernel(self._layer(layer), self.info.scaling)

    def recent_queries(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last ``w`` queries: ``([rows, heads, w, head_dim], positions [rows, w], valid [rows, w])``."""
        window = self.recorded.windows.get(self._layer(layer))
        recorded = None if window is None else window.tensors()
        if recorded is None:
            raise RuntimeError("no queries recorded: the policy must declare query_window in needs()")
        return tuple(self._take(t) for t in recorded)

    def window_attention(self, layer: int | None = None) -> torch.Tensor:
        """Attention of the recorded recent queries over the stored keys, ``[rows, heads, w, slots]``."""
        layer = self._layer(layer)
        queries, q_pos, q_valid = self.recent_queries(layer)
        keys, positions = self.keys(layer), self.positions(layer)
        return attention.window_attention(queries, q_pos, q_valid, keys, positions, self.valid, self.kernel(layer))
