"""The base of the selection policies: the cache holds every token, each decode step reads a few blocks.

A selection policy evicts nothing (``evicts = False``, ``selects = True``). Its budget ``K`` is what one
decode step may read per (row, layer, kv-head), counted in blocks by the policy's ``block_rule``
(:mod:`reasonkv.selection.blocks`). The prefill attends fully, and so do the first ``dense_layers`` layers
at every step. What it offers the
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
        Logical positions per block (each policy's default is its authors').
    dense_layers
        The first this many layers read every token at every step (Quest's are 2).
    """

    evicts: ClassVar[bool] = False
    selects: ClassVar[bool] = True
    granularity: ClassVar[str] = "head"

    sinks: int = 0
    block_size: int = 64
    dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "block_size", 1)
        check_at_least(self, "dense_layers", 0)
        for option, value in (("sinks", self.sinks), ("window", self.window), ("protect_prompt", self.protect_prompt)):
            if value:
                raise ValueError(
                    f"policy {self.name!r} selects (it holds every token and evicts none): {option}={value!r} "
                    "protects tokens from eviction and does not apply; leave it 0"
                )

    @property
    def block_rule(self) -> str:
        """How the budget counts blocks: ``within`` (the current block among ``K // block_size``) or ``plus``."""
        return "within"

    @property
    def capped(self) -> bool:
        """Whether a step reads at most the budget's blocks (False: the uncapped threshold variant)."""
        return True

    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        self.info = info

    def pool_input(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys the side cache pools: post-RoPE, as the attention kernel got them (by default)."""
        return keys

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement block_scores()")
