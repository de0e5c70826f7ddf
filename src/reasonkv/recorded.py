"""Signals kept across forward passes for one cache, read by policies at eviction time: the most
recent post-RoPE queries of every layer and the arguments each layer's attention kernel was called
with (scaling, logit soft-cap, learned sinks). Torch only."""

from __future__ import annotations

import torch

__all__ = ["QueryWindow", "Recorded"]


class QueryWindow:
    """Ring buffer of the last ``w`` queries of one layer, with their positions and validity."""

    def __init__(self, w: int):
        self.w = w
        self.queries: torch.Tensor | None = None  # [batch, heads, w, head_dim]
        self.positions: torch.Tensor | None = None  # [batch, w], -1 where nothing was recorded
        self.valid: torch.Tensor | None = None  # [batch, w]
        self._next = 0

    def push(self, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        b, h, q, d = queries.shape
        if self.queries is None:
            self.queries = queries.new_zeros((b, h, self.w, d))
            self.positions = positions.new_full((b, self.w), -1)
            self.valid = valid.new_zeros((b, self.w))
        if q >= self.w:
            self.queries.copy_(queries[:, :, -self.w :])
            self.positions.copy_(positions[:, -self.w :])
            self.valid.copy_(valid[:, -self.w :])
            self._next = 0
            return
        slots = (torch.arange(q, device=queries.device) + self._next) % self.w
        self.queries[:, :, slots] = queries
        self.positions[:, slots] = positions
        self.valid[:, slots] = valid
        self._next = (self._next + q) % self.w


class Recorded:
    """What the recorder keeps for one cache between forward passes."""

    def __init__(self, query_window: int = 0):
        self.query_window = query_window
        self.windows: dict[int, QueryWindow] = {}  # layer -> its recent queries
        self.scalings: dict[int, float] = {}  # layer -> the scaling its attention kernel used
        self.softcaps: dict[int, float] = {}  # layer -> its logit soft-cap, where the model uses one
        self.sinks: dict[int, torch.Tensor] = {}  # layer -> its learned sink logits [query_heads], if any

    def push_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        window = self.windows.get(layer)
        if window is None:
            window = self.windows[layer] = QueryWindow(self.query_window)
        window.push(queries, positions, valid)

    def reset(self) -> None:
        self.windows = {}
