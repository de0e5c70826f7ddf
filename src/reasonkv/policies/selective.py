"""The base of the selection policies: the cache holds every token, each decode step reads a few blocks.

A selection policy evicts nothing (``evicts = False``, ``selects = True``). Its budget ``K`` is what one
decode step may read per (row, layer, kv-head): the current block and the ``K // block_size - 1`` blocks
it scores highest (:mod:`reasonkv.selection.blocks`). The prefill attends fully. What it offers the
:class:`~reasonkv.selection.reader.Selector`: which keys its pooled side cache summarises
(:meth:`SelectionPolicy.pool_input`) and the block scores of a decode step's query
(:meth:`SelectionPolicy.block_scores`). ``sinks``, ``window`` and ``protect_prompt`` protect tokens from
eviction, which selection never does: they must stay 0 / False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.options import check_at_least
from reasonkv.selection.pooled import PooledKeys

__all__ = ["SelectionPolicy"]


@dataclass
class SelectionPolicy(Policy):
    """Holds all tokens; reads ``budget`` tokens per decode step in blocks of ``block_size`` positions.

    Parameters
    ----------
    sinks
        Must stay 0: selection evicts nothing, so it protects nothing.
    window
        Must stay 0 (as ``sinks``).
    protect_prompt
        Must stay False (as ``sinks``).
    block_size
        Logical positions per block (64, as SeerAttention-R; Quest's pages are 16).
    """

    evicts: ClassVar[bool] = False
    selects: ClassVar[bool] = True
    granularity: ClassVar[str] = "head"

    sinks: int = 0
    block_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "block_size", 1)
        for option, value in (("sinks", self.sinks), ("window", self.window), ("protect_prompt", self.protect_prompt)):
            if value:
                raise ValueError(
                    f"policy {self.name!r} selects (it holds every token and evicts none): {option}={value!r} "
                    "protects tokens from eviction and does not apply; leave it 0"
                )

    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        self.info = info

    def pool_input(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys the side cache pools: post-RoPE, as the attention kernel got them (by default)."""
        return keys

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement block_scores()")
