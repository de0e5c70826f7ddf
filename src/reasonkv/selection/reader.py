"""The selection of one cache: what each decode step's attention reads, and what that cost.

A :class:`Selector` is called by the attention kernel wrapper (:class:`reasonkv.hf.tap.KernelReader`) of
every full-attention layer, with the step's post-RoPE query and the whole cache's K/V (the newest token
already written). It folds the step's new keys into the layer's pooled side cache; on a prefill (more
than one query) it returns nothing and attention stays full, as the authors prefill; on a decode step it
asks the policy for block scores, chooses the blocks (:mod:`reasonkv.selection.blocks`) and returns only
their K/V, with a mask that hides the slots of the chosen blocks that hold no token.

It counts, per row, the K/V tokens read and held at every decode step (summed over layers and kv-heads),
so that the bytes read per step can be reported beside the bytes held.
"""

from __future__ import annotations

from typing import Protocol

import torch

from reasonkv.selection.blocks import BlockChoice, blocks_per_step, choose_blocks, gather_slots, read_slots
from reasonkv.selection.pooled import PooledKeys

__all__ = ["BlockScorer", "Selector"]


class BlockScorer(Protocol):
    """What a selection policy offers the selector."""

    block_size: int

    def pool_input(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys to pool (post-RoPE as given, or rotated back), ``[batch, kv_heads, q, head_dim]``."""

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores ``[batch, kv_heads, blocks]`` of the newest query ``[batch, heads, head_dim]`` at ``position``
        ``[batch]``, and optionally which blocks pass a threshold."""


class Selector:
    """Per-layer pooled side caches, the block choice of each decode step, and the read counters."""

    def __init__(self, policy: BlockScorer, budget: int):
        self.policy = policy
        self.block_size = policy.block_size
        self.budget = budget
        self.budget_blocks = blocks_per_step(budget, self.block_size)
        self.pooled: dict[int, PooledKeys] = {}
        self.last: dict[int, BlockChoice] = {}  # the latest decode step's choice per layer (for inspection)
        self.steps = 0  # decode steps seen
        self.read_tokens: torch.Tensor | None = None  # [batch] K/V tokens read, summed over steps, layers, heads
        self.held_tokens: torch.Tensor | None = None  # [batch] K/V tokens held at those reads
        self.token_bytes = 0  # bytes of one token's K and V in one kv-head
        # Called after each decode read as on_read(layer, choice, read positions [batch, kv_heads, n] (-1: not read),
        # held positions [batch, kv_heads, slots], block scores [batch, kv_heads, blocks], live rows [batch]).
        self.on_read = None
        self._first_layer: int | None = None

    def reset(self) -> None:
        self.pooled.clear()
        self.last.clear()
        self.steps, self.read_tokens, self.held_tokens, self._first_layer = 0, None, None, None

    def side_bytes(self) -> int:
        """Bytes the pooled side caches hold."""
        return sum(p.nbytes() for p in self.pooled.values())

    def read(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_positions: torch.Tensor,
        step_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The K/V (and additive mask ``[batch, heads, 1, n]``) this layer's attention reads this step, or
        None to read everything (prefill). ``slot_positions`` ``[batch, kv_heads, slots]`` (-1: padding),
        ``step_positions`` ``[batch, q]`` the positions of the step's tokens (-1: padding)."""
        q = query.shape[2]
        pooled = self.pooled.get(layer)
        if pooled is None:
            pooled = self.pooled[layer] = PooledKeys(self.block_size)
        pooled.add(self.policy.pool_input(layer, key[:, :, -q:], step_positions), step_positions)
        if q != 1:
            return None
        batch, kv_heads = key.shape[:2]
        if self._first_layer is None:
            self._first_layer = layer
            self.token_bytes = (key.shape[-1] * key.element_size()) + (value.shape[-1] * value.element_size())
        if layer == self._first_layer:
            self.steps += 1
        newest = slot_positions[:, 0].max(dim=-1).values.clamp(min=0)  # [batch]: a padding step reads the last token
        current = newest // self.block_size
        scores, keep = self.policy.block_scores(layer, query[:, :, 0], pooled, newest)
        choice = choose_blocks(scores, current, self.budget_blocks, keep)
        slot, read = read_slots(choice, slot_positions, self.block_size)
        self._count(read, slot_positions)
        self.last[layer] = choice
        if self.on_read is not None:
            positions_read = torch.where(read, slot_positions.gather(2, slot), -1)
            self.on_read(layer, choice, positions_read, slot_positions, scores, step_positions[:, -1] >= 0)
        keys, values = gather_slots(key, slot), gather_slots(value, slot)
        hidden = torch.zeros(read.shape, dtype=query.dtype, device=query.device)
        hidden = hidden.masked_fill(~read, torch.finfo(query.dtype).min)
        mask = hidden.repeat_interleave(query.shape[1] // kv_heads, dim=1).unsqueeze(2)
        return keys, values, mask

    def _count(self, read: torch.Tensor, slot_positions: torch.Tensor) -> None:
        got = read.sum(dim=(1, 2))
        held = (slot_positions >= 0).sum(dim=(1, 2))
        if self.read_tokens is None:
            self.read_tokens, self.held_tokens = torch.zeros_like(got), torch.zeros_like(held)
        self.read_tokens += got
        self.held_tokens += held

    def stats(self, row: int, held_bytes: int | None = None) -> dict:
        """Row ``row``'s reads: K/V bytes read per decode step (all layers and kv-heads), what reading the whole
        cache would have cost, their ratio, and the pooled side caches' bytes."""
        steps = max(self.steps, 1)
        read = 0 if self.read_tokens is None else int(self.read_tokens[row])
        held = 0 if self.held_tokens is None else int(self.held_tokens[row])
        out = {
            "budget": self.budget,
            "block_size": self.block_size,
            "decode_steps": self.steps,
            "kv_bytes_read_per_step": read * self.token_bytes / steps,
            "kv_bytes_full_read_per_step": held * self.token_bytes / steps,
            "read_fraction": read / held if held else float("nan"),
            "side_cache_bytes": self.side_bytes(),
        }
        if held_bytes is not None:
            out["kv_bytes_held"] = held_bytes
        return out
