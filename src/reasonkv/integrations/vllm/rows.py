"""One request's tokens as reasonkv's policies read them: the storage an ``EvictionView`` is built over.

The policies are written for dense per-layer K/V ``[rows, kv_heads, slots, head_dim]`` with logical positions,
a validity mask and a few per-row counters (see :mod:`reasonkv.policies.view`). A request read out of vLLM's
blocks is one such row, with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.recorded import Recorded
from reasonkv.policies.view import EvictionView

__all__ = ["Layer", "RequestRow", "kept_indices"]


@dataclass
class Layer:
    keys: torch.Tensor  # [1, kv_heads, slots, head_dim]
    values: torch.Tensor


class RequestRow:
    """A request's held tokens, every layer, as a one-row cache: ``positions[layer]`` ``[kv_heads, slots]``."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: torch.Tensor,
        *,
        logical: int,
        prompt: int,
        evictions: int,
        budget: int,
    ):
        self.layers = [Layer(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(keys, values, strict=True)]
        self._positions = positions.unsqueeze(1)  # [layers, 1, kv_heads, slots]
        slots = positions.shape[-1]
        self.valid = torch.ones(1, slots, dtype=torch.bool)
        self.next_position = torch.tensor([logical])
        self.prompt_lengths = torch.tensor([prompt])
        self.row_evictions = torch.tensor([evictions])
        self.budget = budget

    def positions(self, layer: int) -> torch.Tensor:
        return self._positions[layer]


def kept_indices(policy, row: RequestRow, info: ModelInfo, recorded: Recorded, seed: torch.Tensor) -> torch.Tensor:
    """The slots each layer and head keeps, ``[layers, kv_heads, K]`` in the order the tokens came, chosen by the
    policy's own ``keep`` (token granularity: one set for every layer and head) or ``keep_layers`` (per head)."""
    view = EvictionView(cache=row, recorded=recorded, policy=policy, rows=torch.tensor([0]), row_seeds=seed, info=info)
    heads = row.layers[0].keys.shape[1]
    if policy.granularity == "token":
        kept = policy.keep(view)[0]  # [K]
        kept = kept.view(1, 1, -1).expand(len(row.layers), heads, -1)
    else:
        kept = torch.stack([k[0] for k in policy.keep_layers(view)])  # [layers, kv_heads, K]
    return kept.sort(dim=-1).values
