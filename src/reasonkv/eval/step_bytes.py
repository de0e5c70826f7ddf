"""What a replay's decode steps held and read: the K/V bytes of the evicting layers, per row, mean over its steps.

An eviction cache reads all it holds; a selection cache's selector counts what each step read. A chunked
replay has no eviction inside a chunk, so its step ``t`` holds the tokens before the chunk plus ``t + 1``.
"""

from __future__ import annotations

import torch

__all__ = ["StepBytes"]


class StepBytes:
    """Sums, per row, the K/V bytes held and read at each decode step of one evicting cache."""

    def __init__(self, cache, batch: int):
        self.cache = cache
        self.selector = getattr(cache.evictor, "selector", None)
        self.batch = batch
        self.held = self.read = self.steps = None  # [batch] sums, on the cache's device once it has one
        self._held_before: torch.Tensor | None = None
        self._read_before: torch.Tensor | None = None

    def before(self) -> None:
        """Called just before a decode forward pass: what each row holds, and what its selector has counted."""
        tiers = self.cache.row_kv_bytes_by_tier()
        self._held_before = (tiers["full"] + tiers["quantized"]).double()
        if self.held is None:
            zeros = torch.zeros(self.batch, dtype=torch.float64, device=self._held_before.device)
            self.held, self.read, self.steps = zeros, zeros.clone(), zeros.clone()
        counted = None if self.selector is None else self.selector.read_tokens
        self._read_before = None if counted is None else counted.clone()

    def after(self, span: int, active: list[int]) -> None:
        """Called just after it: ``span`` tokens were fed to the rows ``active``."""
        device = self._held_before.device
        rows = torch.zeros(self.held.shape[0], dtype=torch.bool, device=device)
        rows[active] = True
        per_token = float(self.cache.full_token_kv_bytes())
        held = span * self._held_before + span * (span + 1) / 2 * per_token
        if self.selector is None:
            read = held
        else:
            counted = self.selector.read_tokens
            before = torch.zeros_like(counted) if self._read_before is None else self._read_before
            read = (counted - before).double() * self.selector.token_bytes
        self.held += torch.where(rows, held, 0.0)
        self.read += torch.where(rows, read.to(device), 0.0)
        self.steps += rows.double() * span

    def per_row(self) -> list[dict[str, float] | None]:
        """Per row: ``held`` and ``read``, the mean K/V bytes per decode step; None for a row with no decode step."""
        if self.held is None:
            return [None] * self.batch
        held, read, steps = self.held.tolist(), self.read.tolist(), self.steps.tolist()
        return [{"held": h / n, "read": r / n} if n else None for h, r, n in zip(held, read, steps, strict=True)]
