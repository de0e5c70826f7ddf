"""Queries kept across forward passes for one cache, read at eviction time, and the arguments each
layer's attention kernel was called with (scaling, logit soft-cap, learned sinks). Torch only.

Both keep *references* to the query tensors the attention kernel already made (no copy per step):
a decode step costs a list append per layer, and the tensors are stacked only when read.

- :class:`QueryWindow`: the most recent ``w`` queries of one layer (SnapKV / VASE / R-KV / TOVA windows);
- :class:`QueryLog`: each forward's newest query that a policy's attention bookkeeping still has to see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.attention import Kernel

__all__ = ["QueryLog", "QueryWindow", "Recorded"]


@dataclass
class _Entry:
    queries: torch.Tensor  # [batch, heads, q, head_dim]
    positions: torch.Tensor  # [batch, q] logical positions (-1: padding)
    valid: torch.Tensor  # [batch, q]


class QueryWindow:
    """The last ``w`` queries of one layer, with their positions and validity."""

    def __init__(self, w: int):
        self.w = w
        self._entries: list[_Entry] = []
        self._count = 0

    def push(self, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        if queries.shape[2] > self.w:
            # Copies, not views: a view of a long prefill's queries would hold all of them (every layer's)
            # until the window moves past, and free them in the middle of the decode steps that follow.
            queries = queries[:, :, -self.w :].clone()
            positions, valid = positions[:, -self.w :].clone(), valid[:, -self.w :].clone()
        self._entries.append(_Entry(queries, positions, valid))
        self._count += queries.shape[2]
        while self._count - self._entries[0].queries.shape[2] >= self.w:
            self._count -= self._entries.pop(0).queries.shape[2]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(queries [batch, heads, w, head_dim], positions [batch, w], valid [batch, w])``, oldest first;
        slots never recorded hold position -1 and are invalid. ``None`` before the first push."""
        if not self._entries:
            return None
        queries = torch.cat([e.queries for e in self._entries], dim=2)[:, :, -self.w :]
        positions = torch.cat([e.positions for e in self._entries], dim=1)[:, -self.w :]
        valid = torch.cat([e.valid for e in self._entries], dim=1)[:, -self.w :]
        missing = self.w - queries.shape[2]
        if missing:
            b, h, _, d = queries.shape
            queries = torch.cat([queries.new_zeros((b, h, missing, d)), queries], dim=2)
            positions = torch.cat([positions.new_full((b, missing), -1), positions], dim=1)
            valid = torch.cat([valid.new_zeros((b, missing)), valid], dim=1)
        return queries, positions, valid


class QueryLog:
    """The newest query of every forward since the last flush, per layer, with the slot it was stored at.

    Every forward passes through every layer, so the slots, positions and validity are kept once per
    forward and the queries once per layer.
    """

    def __init__(self):
        self.slots: list[int] = []
        self.positions: list[torch.Tensor] = []  # [batch, 1] each
        self.valid: list[torch.Tensor] = []  # [batch, 1] each
        self.queries: dict[int, list[torch.Tensor]] = {}  # layer -> [batch, heads, 1, head_dim] each

    def __len__(self) -> int:
        return len(self.slots)

    def add_forward(self, slot: int, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self.slots.append(slot)
        self.positions.append(positions)
        self.valid.append(valid)

    def add_query(self, layer: int, query: torch.Tensor) -> None:
        self.queries.setdefault(layer, []).append(query)

    def take(self) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Empty the log: ``({layer: queries [batch, heads, n, head_dim]}, slots [n], positions, valid)``,
        the last two ``[batch, n]``."""
        device = self.positions[0].device
        slots = torch.tensor(self.slots, device=device)
        positions, valid = torch.cat(self.positions, dim=1), torch.cat(self.valid, dim=1)
        queries = {layer: torch.cat(parts, dim=2) for layer, parts in self.queries.items()}
        self.__init__()
        return queries, slots, positions, valid


class Recorded:
    """What the recorder keeps for one cache between forward passes."""

    def __init__(self, query_window: int = 0):
        self.query_window = query_window
        self.windows: dict[int, QueryWindow] = {}  # layer -> its recent queries
        self.log = QueryLog()  # queries whose attention is still owed to the policy
        self.scalings: dict[int, float] = {}  # layer -> the scaling its attention kernel used
        self.softcaps: dict[int, float] = {}  # layer -> its logit soft-cap, where the model uses one
        self.sinks: dict[int, torch.Tensor] = {}  # layer -> its learned sink logits [query_heads], if any

    def kernel(self, layer: int, scaling: float | None = None) -> Kernel:
        """What ``layer``'s attention kernel was called with (``scaling`` until it is seen)."""
        return Kernel(self.scalings.get(layer, scaling), self.softcaps.get(layer), self.sinks.get(layer))

    def push_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        window = self.windows.get(layer)
        if window is None:
            window = self.windows[layer] = QueryWindow(self.query_window)
        window.push(queries, positions, valid)

    def reset(self) -> None:
        self.windows = {}
        self.log = QueryLog()
