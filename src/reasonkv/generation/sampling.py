"""How the next token of each row is chosen: greedy, or sampled with temperature, top-p and top-k.

Row ``i``'s draw is keyed by its seed and the step alone (inverse CDF of one keyed uniform number), so
a row samples the same tokens in a batch as alone and no per-row call or host read is needed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from reasonkv.policies import noise

__all__ = ["Sampling"]

_SAMPLING_STREAM = 2  # keeps token sampling's draws apart from the eviction's


def _is(value, kind: type) -> bool:
    """``value`` is a ``kind`` (``numbers.Integral`` or ``numbers.Real``), and not a ``bool``."""
    return isinstance(value, kind) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings, validated once: at most ``max_new_tokens`` tokens per row, greedy at
    ``temperature`` 0, else sampled from the ``top_k`` most likely tokens (0: all) within the smallest
    set reaching probability ``top_p``."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not _is(self.max_new_tokens, numbers.Integral) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is(self.temperature, numbers.Real) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seeds(self, row_seeds: torch.Tensor) -> torch.Tensor:
        """The sampling stream of each row's seed (apart from its eviction randomness)."""
        return noise.mix(row_seeds, _SAMPLING_STREAM)

    def draw(self, logits: torch.Tensor, seeds: torch.Tensor, step: int) -> torch.Tensor:
        """One token per row from ``logits`` ``[batch, vocab]``; ``seeds`` from :meth:`seeds`."""
        if self.greedy:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) > self.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        cdf = logits.softmax(-1).double().cumsum(-1)
        draw = noise.uniform(noise.mix(seeds, step), torch.float64).unsqueeze(1) * cdf[:, -1:]
        return torch.searchsorted(cdf, draw).clamp(max=logits.shape[-1] - 1).squeeze(1)
