"""From block scores to the slots one decode step reads.

Each (row, kv-head) reads the current block (the one the newest token is in, always) and the
``budget // block_size - 1`` best-scored complete blocks before it, so a step never reads more than
``budget`` tokens per head. A block is a candidate once it lies wholly before the current block; early
in a generation fewer blocks than the budget allows exist, and then all of them are read (a budget that
covers every block reads the whole cache: the oracle of selection).

Slots follow the cache's layout: a row's tokens are contiguous in slot order and right-aligned, so the
slot of logical position ``p`` is the slot of position 0 plus ``p``. Every slot read is checked against
the position it should hold; one that does not (past the end, padding) is masked out, never attended.
"""

from __future__ import annotations

import torch

__all__ = ["BlockChoice", "blocks_per_step", "choose_blocks", "read_slots", "gather_slots"]

NOT_A_CANDIDATE = float("-inf")


def blocks_per_step(budget: int, block_size: int) -> int:
    """Blocks a step reads, the current one included: ``budget // block_size`` (at least one)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < block_size:
        raise ValueError(
            f"a selection budget must be at least one block ({block_size} tokens): got {budget!r} "
            f"(each step reads the current block and budget // {block_size} - 1 more)"
        )
    return budget // block_size


class BlockChoice:
    """The blocks a step reads per (row, kv-head): ``blocks`` ``[batch, kv_heads, n]`` in ascending order,
    the current block last, and ``chosen`` ``[batch, kv_heads, n]`` False where a pick is not a real block."""

    def __init__(self, blocks: torch.Tensor, chosen: torch.Tensor):
        self.blocks, self.chosen = blocks, chosen


def choose_blocks(
    scores: torch.Tensor, current: torch.Tensor, budget_blocks: int, keep: torch.Tensor | None = None
) -> BlockChoice:
    """The top ``budget_blocks - 1`` candidates of ``scores`` ``[batch, kv_heads, blocks]`` (higher is read
    first) and the current block ``current`` ``[batch]``. Candidates: blocks before the current one (and,
    given ``keep`` ``[batch, kv_heads, blocks]``, where it is True: the threshold variant)."""
    batch, heads, blocks = scores.shape
    index = torch.arange(blocks, device=scores.device)
    candidate = index.view(1, 1, -1) < current.view(-1, 1, 1)
    if keep is not None:
        candidate = candidate & keep
    k = min(budget_blocks - 1, blocks)
    if k > 0:
        masked = scores.float().masked_fill(~candidate, NOT_A_CANDIDATE)
        top, picked = masked.topk(k, dim=-1)
        chosen = top > NOT_A_CANDIDATE
        # Ascending block order (unchosen picks last), so that reading every block reads slots in cache order.
        order = torch.where(chosen, picked, blocks).argsort(dim=-1)
        picked, chosen = picked.gather(-1, order), chosen.gather(-1, order)
    else:
        picked = scores.new_zeros((batch, heads, 0), dtype=torch.long)
        chosen = torch.zeros((batch, heads, 0), dtype=torch.bool, device=scores.device)
    now = current.view(-1, 1, 1).expand(batch, heads, 1)
    blocks_read = torch.cat([picked, now], dim=-1)
    chosen = torch.cat([chosen, torch.ones_like(now, dtype=torch.bool)], dim=-1)
    return BlockChoice(blocks_read, chosen)


def read_slots(choice: BlockChoice, slot_positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot indices ``[batch, kv_heads, n * block_size]`` of the chosen blocks and whether each is read
    (holds the position the block says). ``slot_positions`` ``[batch, kv_heads, slots]``: the logical
    position of every stored slot (-1: padding)."""
    batch, heads, slots = slot_positions.shape
    first = (slot_positions[:, 0] == 0).float().argmax(dim=-1)  # the slot of position 0, per row
    offset = torch.arange(block_size, device=slot_positions.device)
    wanted = (choice.blocks.unsqueeze(-1) * block_size + offset).flatten(-2)  # logical positions read
    slot = first.view(-1, 1, 1) + wanted
    inside = (slot >= 0) & (slot < slots)
    slot = slot.clamp(0, slots - 1)
    held = slot_positions.gather(2, slot) == wanted
    read = inside & held & choice.chosen.repeat_interleave(block_size, dim=-1)
    return slot, read


def gather_slots(tensor: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``tensor[b, h, slot[b, h, i]]`` as ``[batch, kv_heads, n, dim]``: only these rows of K or V are read."""
    return tensor.gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1]))
