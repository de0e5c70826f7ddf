"""The pooled side cache: per (row, kv-head, block) statistics of the keys, kept as tokens arrive.

A selection policy scores blocks of ``block_size`` logical positions from a summary of their keys: for one
layer, the elementwise minimum, maximum and sum of each block's keys and its token count. Each forward
folds its new keys in by logical position (:meth:`PooledKeys.add`; padding goes nowhere), so rows at
different positions each land in their own blocks. :func:`pool_keys` is the same summary computed at once,
the reference."""

from __future__ import annotations

import torch

__all__ = ["PooledKeys", "pool_keys"]

_EMPTY = (float("inf"), float("-inf"), 0.0)  # an empty block's minimum, maximum and sum


class PooledKeys:
    """Min, max and sum of the keys of each block, for ``[batch, kv_heads]`` rows of one layer.

    ``minimum``, ``maximum``, ``total``: ``[batch, kv_heads, blocks, head_dim]`` float32 (``+inf`` / ``-inf``
    / 0 where a block holds no token yet); ``counts``: ``[batch, blocks]`` tokens per block.
    """

    def __init__(self, block_size: int):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._min: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self.blocks = 0  # blocks in use: one past the highest block any row has a token in

    # ------------------------------------------------------------------ views: the blocks in use
    minimum = property(lambda self: self._min[:, :, : self.blocks])
    maximum = property(lambda self: self._max[:, :, : self.blocks])
    total = property(lambda self: self._sum[:, :, : self.blocks])
    counts = property(lambda self: self._counts[:, : self.blocks])

    @property
    def mean(self) -> torch.Tensor:
        """Mean key of each block (0 where a block holds no token)."""
        counts = self.counts.clamp(min=1).to(self._sum.dtype)
        return self.total / counts[:, None, :, None]

    def nbytes(self) -> int:
        """Bytes this side cache holds (allocated)."""
        if self._min is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._min, self._max, self._sum, self._counts))

    # ------------------------------------------------------------------ update
    def add(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Fold ``keys`` ``[batch, kv_heads, q, head_dim]`` at logical ``positions`` ``[batch, q]`` (-1: padding)
        into their blocks."""
        batch, heads, q, dim = keys.shape
        if positions.shape != (batch, q):
            raise ValueError(f"positions must be [batch, q] = {[batch, q]}, got {list(positions.shape)}")
        real = positions >= 0
        block = torch.where(real, positions, 0) // self.block_size
        needed = int(block.max()) + 1 if bool(real.any()) else 0
        self._grow(batch, heads, dim, needed, keys.device)
        spare = self._min.shape[2] - 1  # the last column takes the padding and is never read
        block = torch.where(real, block, spare)
        index = block[:, None, :, None].expand(batch, heads, q, dim)
        values = keys.float()
        self._min.scatter_reduce_(2, index, values, "amin", include_self=True)
        self._max.scatter_reduce_(2, index, values, "amax", include_self=True)
        self._sum.scatter_add_(2, index, values)
        self._counts.scatter_add_(1, block, real.long())
        for t, fill in zip((self._min, self._max, self._sum), _EMPTY, strict=True):
            t[:, :, spare] = fill
        self._counts[:, spare] = 0
        self.blocks = max(self.blocks, needed)

    def _grow(self, batch: int, heads: int, dim: int, needed: int, device: torch.device) -> None:
        have = 0 if self._min is None else self._min.shape[2] - 1
        if self._min is not None and needed <= have:
            return
        size = max(needed, 2 * have, 8)
        shape = (batch, heads, size + 1, dim)
        grown = [torch.full(shape, fill, device=device) for fill in _EMPTY]
        counts = torch.zeros((batch, size + 1), dtype=torch.long, device=device)
        if self._min is not None:
            for new, old in zip(grown, (self._min, self._max, self._sum), strict=True):
                new[:, :, :have] = old[:, :, :have]
            counts[:, :have] = self._counts[:, :have]
        self._min, self._max, self._sum = grown
        self._counts = counts


def pool_keys(
    keys: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min, max, sum ``[batch, kv_heads, blocks, head_dim]`` and counts ``[batch, blocks]`` of ``keys``
    ``[batch, kv_heads, slots, head_dim]`` at ``positions`` ``[batch, slots]`` (-1: padding), block by block
    with a Python loop: the plain reference :class:`PooledKeys` must equal."""
    batch, heads, _, dim = keys.shape
    blocks = int(positions.max()) // block_size + 1 if bool((positions >= 0).any()) else 0
    low = torch.full((batch, heads, blocks, dim), float("inf"))
    high = torch.full((batch, heads, blocks, dim), float("-inf"))
    total = torch.zeros((batch, heads, blocks, dim))
    counts = torch.zeros((batch, blocks), dtype=torch.long)
    for b in range(batch):
        for j in range(blocks):
            inside = (positions[b] >= j * block_size) & (positions[b] < (j + 1) * block_size)
            if bool(inside.any()):
                chosen = keys[b][:, inside].float().cpu()
                low[b, :, j], high[b, :, j] = chosen.amin(1), chosen.amax(1)
                total[b, :, j], counts[b, j] = chosen.sum(1), int(inside.sum())
    return low, high, total, counts
