"""The cache of a selection policy (Quest, SeerAttention): it holds every token, and chooses inside each decode
step's attention kernel what is read (:class:`~reasonkv.selection.reader.Selector`).

It runs the evictor's forward (positions, masks, the policy's signals) and evicts nothing (its storage has no
budget); a :class:`~reasonkv.hf.KernelReader` on the full-attention layers hands the selector each call.
"""

from __future__ import annotations

import torch

from reasonkv.cache.evictor import Evictor
from reasonkv.selection.reader import Selector

__all__ = ["Selecting"]


class Selecting(Evictor):
    """An :class:`~reasonkv.cache.evictor.Evictor` whose policy selects instead of evicting."""

    def __init__(self, model, cache, spec, *, sync_timing: bool = False):
        super().__init__(model, cache, spec, sync_timing=sync_timing)
        self.selector = Selector(self.policy, spec.budget)

    def listen(self, log) -> None:
        """Hand every read to ``log`` (None: to nobody)."""
        super().listen(log)
        self.selector.on_read = None if log is None else log.read

    def _start(self, batch: int, device: torch.device) -> None:
        super()._start(batch, device)
        self.selector.reset()

    def _read(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """A selection policy's read of one layer's attention (see :class:`~reasonkv.selection.reader.Selector`)."""
        cache = self.cache
        return self.selector.read(layer, query, key, value, cache.layers[layer].positions, cache.rows.step_positions)
