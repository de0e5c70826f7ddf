"""Building blocks shared by several policies (pure tensor code, no transformers import)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PositionTable", "group_mean", "pool1d"]


class PositionTable:
    """Per-token state indexed by logical position: ``[batch, *inner, positions]`` floats.

    Policies keep their per-token state (a score computed when the token arrived, an accumulated
    attention mass, a timestamp) here rather than aligned to cache slots: eviction reorders slots
    but never changes a token's logical position, so nothing has to follow the cache's gathers.
    Memory is O(tokens) scalars per inner index. Capacity grows by doubling.
    """

    def __init__(self, batch: int, inner: tuple[int, ...] = (), *, fill: float = 0.0, device=None):
        self.fill = fill
        self.data = torch.full((batch, *inner, 64), fill, dtype=torch.float32, device=device)

    def _reserve(self, needed: int) -> None:
        capacity = self.data.shape[-1]
        if needed <= capacity:
            return
        grown = self.data.new_full((*self.data.shape[:-1], max(needed, 2 * capacity)), self.fill)
        grown[..., :capacity] = self.data
        self.data = grown

    def _index(self, positions: torch.Tensor) -> torch.Tensor:
        """Broadcast ``positions`` to the table's leading dims; padding (-1) maps to position 0."""
        index = positions.clamp(min=0)
        while index.dim() < self.data.dim():
            index = index.unsqueeze(1)
        return index.expand(*self.data.shape[:-1], index.shape[-1])

    def get(self, positions: torch.Tensor) -> torch.Tensor:
        """Values at ``positions`` (``[batch, S]`` or ``[batch, *inner, S]``); padding reads ``fill``."""
        self._reserve(int(positions.max()) + 1 if positions.numel() else 1)
        values = self.data.gather(-1, self._index(positions))
        pad = positions < 0
        while pad.dim() < values.dim():
            pad = pad.unsqueeze(1)
        return values.masked_fill(pad, self.fill)

    def set(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` at ``positions``; entries at padding positions (-1) are ignored."""
        self._reserve(int(positions.max()) + 1 if positions.numel() else 1)
        index = self._index(positions)
        current = self.data.gather(-1, index)
        pad = positions < 0
        while pad.dim() < current.dim():
            pad = pad.unsqueeze(1)
        self.data.scatter_(-1, index, torch.where(pad, current, values.float().expand_as(current)))

    def add(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at ``positions`` (padding ignored; repeated positions accumulate)."""
        self._reserve(int(positions.max()) + 1 if positions.numel() else 1)
        index = self._index(positions)
        pad = positions < 0
        while pad.dim() < index.dim():
            pad = pad.unsqueeze(1)
        self.data.scatter_add_(-1, index, values.float().expand(index.shape).masked_fill(pad, 0.0))

    def take_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The full table of some batch rows (for inspection and tests)."""
        return self.data.index_select(0, rows)


def group_mean(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Average per-query-head scores over each kv group: ``[B, Hq, ...] -> [B, Hkv, ...]``.

    Query head ``h`` reads kv head ``h // (Hq // Hkv)``, as in transformers' ``repeat_kv``.
    """
    b, hq = scores.shape[:2]
    return scores.reshape(b, kv_heads, hq // kv_heads, *scores.shape[2:]).mean(2)


def pool1d(scores: torch.Tensor, kernel: int, mode: str = "max") -> torch.Tensor:
    """Same-length 1-D pooling along the last (slot) axis, as SnapKV smooths its scores."""
    if kernel <= 1:
        return scores
    if mode not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1]).float()
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled[..., : shape[-1]].reshape(shape)
