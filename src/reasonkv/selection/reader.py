"""The selection of one cache: what each decode step's attention reads, and what that cost.

A :class:`Selector` is called by the kernel reader (:class:`reasonkv.hf.tap.KernelReader`) of every
full-attention layer with the step's post-RoPE query and the whole cache's K/V. It folds the new keys into
the layer's pooled side cache; a prefill and the policy's dense layers read everything. On other decode
steps it chooses blocks (:mod:`reasonkv.selection.blocks`) and returns only their K/V, masking the slots that
hold no token (and, per query head, the blocks that head did not choose). It counts the tokens read and held
per row at every step, so the bytes read can be reported beside the bytes held."""

from __future__ import annotations

from typing import Protocol

import torch

from reasonkv.selection.blocks import (
    BlockChoice,
    blocks_per_step,
    choose_blocks,
    gather_slots,
    read_slots,
    union_choice,
)
from reasonkv.selection.pooled import PooledKeys

__all__ = ["BlockScorer", "Selector"]


class BlockScorer(Protocol):
    """What a selection policy offers the selector."""

    block_size: int
    dense_layers: int  # layers 0 .. dense_layers - 1 read every token
    block_rule: str  # "within" or "plus" (reasonkv.selection.blocks)
    capped: bool  # False: every block that passes the threshold is read, whatever the budget

    def pool_input(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys to pool (post-RoPE as given, or rotated back), ``[batch, kv_heads, q, head_dim]``."""

    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores ``[batch, kv_heads, blocks]`` (or ``[batch, heads, blocks]``: one choice per query head) of the
        newest query ``[batch, heads, head_dim]`` at ``position`` ``[batch]``, and optionally which blocks pass
        a threshold."""


class Selector:
    """Per-layer pooled side caches, the block choice of each decode step, and the read counters."""

    def __init__(self, policy: BlockScorer, budget: int):
        self.policy = policy
        self.budget = budget
        self.budget_blocks = blocks_per_step(budget, policy.block_size) if policy.capped else None
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
        dense = layer < self.policy.dense_layers
        if not dense:  # a dense layer scores no block: it keeps no side cache
            pooled = self.pooled.get(layer)
            if pooled is None:
                pooled = self.pooled[layer] = PooledKeys(self.policy.block_size)
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
        current = newest // self.policy.block_size
        if dense:
            return self._read_all(layer, slot_positions, current, step_positions)
        scores, keep = self.policy.block_scores(layer, query[:, :, 0], pooled, newest)
        choice = choose_blocks(scores, current, self.budget_blocks, keep, self.policy.block_rule)
        mine = None
        if scores.shape[1] != kv_heads:  # one choice per query head: the kv-head reads their union once
            choice, mine = union_choice(choice, kv_heads, scores.shape[-1])
            scores = scores.view(batch, kv_heads, -1, scores.shape[-1]).amax(2)
        slot, read = read_slots(choice, slot_positions, self.policy.block_size)
        self._count(read, slot_positions)
        self.last[layer] = choice
        if self.on_read is not None:
            positions_read = torch.where(read, slot_positions.gather(2, slot), -1)
            self.on_read(layer, choice, positions_read, slot_positions, scores, step_positions[:, -1] >= 0)
        keys, values = gather_slots(key, slot), gather_slots(value, slot)
        group = query.shape[1] // kv_heads
        attended = read.repeat_interleave(group, dim=1)
        if mine is not None:  # each query head attends to its own blocks of the union
            attended = attended & mine.repeat_interleave(self.policy.block_size, dim=-1)
        hidden = torch.zeros(attended.shape, dtype=query.dtype, device=query.device)
        mask = hidden.masked_fill(~attended, torch.finfo(query.dtype).min).unsqueeze(2)
        return keys, values, mask

    def _read_all(self, layer: int, slot_positions: torch.Tensor, current: torch.Tensor, step_positions) -> None:
        """A dense layer reads every token it holds (counted so); for inspection, every block up to the current."""
        self._count(slot_positions >= 0, slot_positions)
        if self.on_read is not None:
            batch, kv_heads, _ = slot_positions.shape
            index = torch.arange(int(current.max()) + 1, device=current.device).view(1, 1, -1)
            blocks = torch.minimum(index, current.view(-1, 1, 1)).expand(batch, kv_heads, -1)
            choice = BlockChoice(blocks, (index <= current.view(-1, 1, 1)).expand(batch, kv_heads, -1))
            scores = torch.zeros(blocks.shape, device=current.device)  # a dense layer scores nothing
            self.on_read(layer, choice, slot_positions, slot_positions, scores, step_positions[:, -1] >= 0)

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
            "block_size": self.policy.block_size,
            "decode_steps": self.steps,
            "kv_bytes_read_per_step": read * self.token_bytes / steps,
            "kv_bytes_full_read_per_step": held * self.token_bytes / steps,
            "read_fraction": read / held if held else float("nan"),
            "side_cache_bytes": self.side_bytes(),
        }
        if held_bytes is not None:
            out["kv_bytes_held"] = held_bytes
        return out
