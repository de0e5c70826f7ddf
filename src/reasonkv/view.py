"""What a policy may read at eviction time: the rows being evicted, their stored K/V, positions and
the recorded signals. A serving engine that reuses ``policies/`` implements this same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv import select

__all__ = ["ModelInfo", "EvictionView"]


@dataclass(frozen=True)
class ModelInfo:
    """The attention shape of a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config) -> ModelInfo:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, heads, kv_heads, head_dim)


class EvictionView:
    """The evicted rows' view of the cache and the observer, for one eviction.

    ``layer`` is ``None`` for token-granularity policies (one call for all layers) and the layer
    being scored for head-granularity ones. Tensors have the evicted rows as their first dimension.
    """

    def __init__(self, *, cache, observer, policy, rows, generators, info: ModelInfo, layer: int | None = None):
        self.cache, self.observer, self.policy = cache, observer, policy
        self.rows = rows
        self.generators = generators  # one torch.Generator per evicted row
        self.info = info
        self.layer = layer
        self.budget: int = cache.budget
        self._all_rows = rows.numel() == cache.valid.shape[0] and bool(
            (rows == torch.arange(rows.numel(), device=rows.device)).all()
        )

    def at(self, layer: int) -> EvictionView:
        """The same eviction, seen from one layer (head-granularity scoring)."""
        return EvictionView(
            cache=self.cache,
            observer=self.observer,
            policy=self.policy,
            rows=self.rows,
            generators=self.generators,
            info=self.info,
            layer=layer,
        )

    def _take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._all_rows else tensor.index_select(0, self.rows.to(tensor.device))

    def _layer(self, layer: int | None) -> int:
        layer = self.layer if layer is None else layer
        if layer is None:
            raise ValueError("this view scores all layers at once: pass a layer index")
        return layer

    # -- stored state ---------------------------------------------------------------------------
    def keys(self, layer: int | None = None) -> torch.Tensor:
        """``[rows, kv_heads, slots, head_dim]`` (post-RoPE keys, as stored)."""
        return self._take(self.cache.layers[self._layer(layer)].keys)

    def values(self, layer: int | None = None) -> torch.Tensor:
        """``[rows, kv_heads, slots, head_dim]``."""
        return self._take(self.cache.layers[self._layer(layer)].values)

    def positions(self, layer: int | None = None) -> torch.Tensor:
        """Logical positions ``[rows, kv_heads, slots]`` (-1: padding)."""
        return self._take(self.cache.positions(self._layer(layer)))

    def token_positions(self) -> torch.Tensor:
        """``[rows, slots]`` for token-granularity policies (identical in every layer and head)."""
        return self._take(self.cache.positions(0)[:, 0])

    @property
    def valid(self) -> torch.Tensor:
        """``[rows, slots]``: real tokens (False: padding)."""
        return self._take(self.cache.valid)

    def valid_mask(self) -> torch.Tensor:
        """``valid`` shaped to broadcast against this view's scores."""
        return self.valid if self.layer is None else self.valid.unsqueeze(1)

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

    def protected(self) -> torch.Tensor:
        """Slots the policy's sinks / window / prompt protection keep, shaped like the scores."""
        positions = self.token_positions() if self.layer is None else self.positions()
        p = self.policy
        return select.protected_mask(
            positions,
            sinks=p.sinks,
            window=p.window,
            newest=self.newest,
            prompt_lengths=self.prompt_lengths if p.protect_prompt else None,
        )

    # -- recorded signals -------------------------------------------------------------------------
    def recent_queries(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last ``w`` queries: ``([rows, heads, w, head_dim], positions [rows, w], valid [rows, w])``."""
        window = self.observer.windows.get(self._layer(layer))
        if window is None or window.queries is None:
            raise RuntimeError("no queries recorded: the policy must declare query_window in needs()")
        return self._take(window.queries), self._take(window.positions), self._take(window.valid)

    def window_attention(self, layer: int | None = None) -> torch.Tensor:
        """Attention of the recorded recent queries over the stored keys, ``[rows, heads, w, slots]``."""
        from reasonkv.observe import recent_window_attention

        layer = self._layer(layer)
        queries, q_pos, q_valid = self.recent_queries(layer)
        scaling = self.observer.scalings.get(layer, self.info.scaling)
        return recent_window_attention(
            queries, q_pos, q_valid, self.keys(layer), self.positions(layer), self.valid, scaling
        )
