"""The base of the selection policies: the cache holds every token, each decode step reads a few blocks.

A selection policy evicts nothing. Its budget ``K`` is what one decode step may read per (row, layer,
kv-head), counted in blocks by its ``block_rule`` (:mod:`reasonkv.selection.blocks`); it offers the
:class:`~reasonkv.selection.reader.Selector` the keys its side cache pools (:meth:`SelectionPolicy.pool_input`)
and the block scores of a step's query (:meth:`SelectionPolicy.block_scores`). It has no ``sinks``, ``window``
or ``protect_prompt`` (the registry refuses them, naming the option); its records state them as none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.options import check_at_least
from reasonkv.selection.pooled import PooledKeys

__all__ = ["PROTECTION", "SelectionPolicy"]

PROTECTION = ("sinks", "window", "protect_prompt")  # an evicting policy's options that a selection policy lacks


@dataclass
class SelectionPolicy(Policy):
    """Holds all tokens; reads ``budget`` tokens per decode step in blocks of ``block_size`` positions.

    Parameters
    ----------
    block_size
        Logical positions per block (each policy's default is its authors').
    dense_layers
        The first this many layers read every token at every step (Quest's are 2).
    """

    evicts: ClassVar[bool] = False
    selects: ClassVar[bool] = True
    granularity: ClassVar[str] = "head"

    # What an evicting policy protects from eviction: constants here, not options, since nothing is evicted.
    sinks: ClassVar[int] = 0
    window: ClassVar[int] = 0
    protect_prompt: ClassVar[bool] = False

    block_size: int = 64
    dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "block_size", 1)
        check_at_least(self, "dense_layers", 0)

    def config(self) -> dict[str, object]:
        """As every policy's, the protection (none) among them, so that records of every policy have one shape."""
        policy, *options = super().config().items()
        return dict([policy, *((name, getattr(self, name)) for name in PROTECTION), *options])

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
