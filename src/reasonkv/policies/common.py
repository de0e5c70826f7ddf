"""Building blocks shared by several policies (pure tensor code, no transformers import)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["WORKSPACE_ELEMENTS", "LayerHeadTable", "PositionTable", "bundled_file", "group_mean", "pool1d"]

# The most elements of keys a policy copies (and upcasts) at once at an eviction: R-KV's redundancy and
# ThinKV's K-means read every layer's keys in pieces of this size, never the whole cache at once.
WORKSPACE_ELEMENTS = 1 << 24


class PositionTable:
    """Per-token state indexed by logical position: ``[batch, *inner, positions]`` floats.

    Eviction reorders slots but never changes a token's logical position, so state kept here (a score, an
    accumulated attention mass, a timestamp) never follows the cache's gathers. Capacity grows by doubling;
    writers pass ``bound``, a host-side number above every position written (``Step.position_bound``), so
    sizing the table never reads a device value (without it the largest position is read).
    """

    def __init__(self, batch: int, inner: tuple[int, ...] = (), *, fill: float = 0.0, device=None):
        self.fill = fill
        # One column beyond the capacity is scratch space: writes at padding positions land there,
        # so a write never needs a data-dependent mask (no device synchronisation).
        self.data = torch.full((batch, *inner, 64 + 1), fill, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[-1] - 1

    @property
    def values(self) -> torch.Tensor:
        """The whole table, ``[batch, *inner, capacity]`` (a view without the scratch column)."""
        return self.data[..., : self.capacity]

    def _reserve(self, needed: int) -> None:
        capacity = self.capacity
        if needed <= capacity:
            return
        grown = self.data.new_full((*self.data.shape[:-1], max(needed, 2 * capacity) + 1), self.fill)
        grown[..., :capacity] = self.data[..., :capacity]
        self.data = grown

    def _target(self, at: tuple[int, ...]) -> torch.Tensor:
        """The table, or the view of it at leading inner indices ``at`` (a layer, say)."""
        return self.data[(slice(None), *at)] if at else self.data

    @staticmethod
    def _index(target: torch.Tensor, positions: torch.Tensor, padding_to: int = 0) -> torch.Tensor:
        """Broadcast ``positions`` to ``target``'s leading dims; padding (-1) maps to ``padding_to``."""
        index = torch.where(positions < 0, padding_to, positions)
        while index.dim() < target.dim():
            index = index.unsqueeze(1)
        return index.expand(*target.shape[:-1], index.shape[-1])

    def _bound(self, positions: torch.Tensor, bound: int | None) -> None:
        self._reserve(bound if bound is not None else int(positions.max()) + 1 if positions.numel() else 1)

    def _written(self, positions: torch.Tensor, bound: int | None, at: tuple[int, ...]):
        """The table (grown to ``bound``) and the index that writes ``positions`` in it; padding (-1) lands past
        the capacity, where nothing reads."""
        self._bound(positions, bound)
        target = self._target(at)
        return target, self._index(target, positions, padding_to=self.capacity)

    def get(self, positions: torch.Tensor, bound: int | None = None, at: tuple[int, ...] = ()) -> torch.Tensor:
        """Values at ``positions`` (``[batch, S]`` or ``[batch, *inner, S]``); padding reads ``fill``.

        ``at`` fixes leading inner indices first (``at=(layer,)`` on a ``[batch, layers, heads, T]`` table).
        """
        self._bound(positions, bound)
        target = self._target(at)
        values = target.gather(-1, self._index(target, positions))
        pad = positions < 0
        while pad.dim() < values.dim():
            pad = pad.unsqueeze(1)
        return values.masked_fill(pad, self.fill)

    def set(
        self, positions: torch.Tensor, values: torch.Tensor, bound: int | None = None, at: tuple[int, ...] = ()
    ) -> None:
        """Write ``values`` at ``positions``; entries at padding positions (-1) are not written."""
        target, index = self._written(positions, bound, at)
        target.scatter_(-1, index, values.float().expand(index.shape))

    def add(
        self, positions: torch.Tensor, values: torch.Tensor, bound: int | None = None, at: tuple[int, ...] = ()
    ) -> None:
        """Add ``values`` at ``positions`` (padding ignored; repeated positions accumulate)."""
        target, index = self._written(positions, bound, at)
        target.scatter_add_(-1, index, values.float().expand(index.shape))

    def lookup(self, rows: torch.Tensor, positions: torch.Tensor, *inner: int) -> torch.Tensor:
        """Values for some batch ``rows`` at ``positions``, after fixing leading inner indices.

        ``table.lookup(rows, positions, layer)`` on a ``[batch, layers, heads, T]`` table reads
        ``[rows, heads, S]``. Padding and positions never written read ``fill``. The lookup never
        grows the table nor synchronises with the device.
        """
        data = self.values[(slice(None), *inner)].index_select(0, rows.to(self.data.device))
        outside = (positions < 0) | (positions >= self.capacity)
        return data.gather(-1, positions.clamp(0, self.capacity - 1)).masked_fill(outside, self.fill)


class LayerHeadTable(PositionTable):
    """A :class:`PositionTable` ``[batch, full-attention layers, kv_heads, positions]``: per-token state of each kv
    head of the evicting layers, ``row[layer]`` the inner index of an evicting layer (``at=(row[layer],)``)."""

    def __init__(self, info, batch: int, *, fill: float = 0.0, device=None):
        self.row = {layer: i for i, layer in enumerate(info.full_layers)}
        self.kv_heads = info.num_kv_heads
        super().__init__(batch, (len(self.row), self.kv_heads), fill=fill, device=device)


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
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1]).float()
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled[..., : shape[-1]].reshape(shape)


def bundled_file(folder: tuple[str, ...], load: Callable, info, who: str, what: str, remedy: str) -> tuple:
    """The file the package ships in ``folder`` (package, then subfolders) for this model, matched by its weights
    fingerprint, as ``(load(path), file name)``; ``ValueError`` naming ``who``, the files shipped and ``remedy``
    when there is none."""
    root = resources.files(folder[0]).joinpath(*folder[1:])
    names = sorted(entry.name for entry in root.iterdir() if entry.name.endswith(".pt")) if root.is_dir() else []
    for name in names:
        with resources.as_file(root.joinpath(name)) as path:
            loaded = load(Path(path))
        if loaded.fingerprint and loaded.fingerprint == info.fingerprint:
            return loaded, name
    shipped = ", ".join(name.removesuffix(".pt") for name in names) or "none"
    raise ValueError(
        f"{who}: the package ships no {what} for this model (fingerprint {info.fingerprint or 'unknown'}; "
        f"shipped: {shipped}); {remedy}"
    )
