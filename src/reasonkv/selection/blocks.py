"""From block scores to the slots one decode step reads (docs/selection.md).

Each (row, kv-head) reads the current block (the newest token's) and the best-scored blocks by one rule
(:func:`choose_blocks`): ``within``, the ``budget // block_size - 1`` best complete blocks before the current
one (never more than ``budget`` tokens, Quest's pages); ``plus``, the ``budget // block_size`` best of all,
then the current block if not among them (SeerAttention-R). When fewer blocks exist all are read; without a
budget (the threshold variant) every candidate that passes ``keep`` is. A per-query-head choice makes each
kv-head read its group's union once (:func:`union_choice`). A row's tokens are contiguous and right-aligned,
so position ``p`` sits ``p`` slots after position 0; a slot read that does not hold the position it should is
masked out."""

from __future__ import annotations

import torch

__all__ = ["RULES", "BlockChoice", "blocks_per_step", "choose_blocks", "gather_slots", "read_slots", "union_choice"]

RULES = ("within", "plus")

NOT_A_CANDIDATE = float("-inf")


def blocks_per_step(budget: int, block_size: int) -> int:
    """``budget // block_size`` (at least one): the blocks a step reads under ``within``, the current one
    included; the blocks chosen before the current one is added under ``plus``."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < block_size:
        raise ValueError(
            f"a selection budget must be at least one block ({block_size} tokens): got {budget!r} "
            f"(each step reads budget // {block_size} blocks, the current one included or added)"
        )
    return budget // block_size


class BlockChoice:
    """The blocks a step reads per (row, head): ``blocks`` ``[batch, heads, n]`` in ascending order, the current
    block last, and ``chosen`` ``[batch, heads, n]`` False where a pick is not a real block (or repeats one)."""

    def __init__(self, blocks: torch.Tensor, chosen: torch.Tensor):
        self.blocks, self.chosen = blocks, chosen


def choose_blocks(
    scores: torch.Tensor,
    current: torch.Tensor,
    budget_blocks: int | None,
    keep: torch.Tensor | None = None,
    rule: str = "within",
) -> BlockChoice:
    """The blocks ``rule`` reads from ``scores`` ``[batch, heads, blocks]`` (higher first) and the current block
    ``current`` ``[batch]``, the current block last; ``budget_blocks`` None: every candidate; ``keep``: only
    blocks where it is True are candidates."""
    if rule not in RULES:
        raise ValueError(f"a block rule must be one of {', '.join(RULES)}, got {rule!r}")
    batch, heads, blocks = scores.shape
    index = torch.arange(blocks, device=scores.device)
    candidate = index.view(1, 1, -1) < current.view(-1, 1, 1) + (rule == "plus")  # "plus" may pick the current one
    if keep is not None:
        candidate = candidate & keep
    k = blocks if budget_blocks is None else min(budget_blocks - (rule == "within"), blocks)
    if k > 0:
        masked = scores.float().masked_fill(~candidate, NOT_A_CANDIDATE)
        top, picked = masked.topk(k, dim=-1)
        # The current block is added below; a pick of it here is not read twice.
        chosen = (top > NOT_A_CANDIDATE) & (picked != current.view(-1, 1, 1))
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


def union_choice(choice: BlockChoice, kv_heads: int, blocks: int) -> tuple[BlockChoice, torch.Tensor]:
    """Per-query-head ``choice`` ``[batch, heads, n]`` -> what each kv-head reads, the union of its group's
    blocks (each once, ascending, the current block last), and ``mine`` ``[batch, heads, m]``: whether each
    query head chose each block of its kv-head's union."""
    batch, heads, _ = choice.blocks.shape
    member = torch.zeros((batch, heads, blocks + 1), dtype=torch.bool, device=choice.blocks.device)
    member.scatter_(-1, torch.where(choice.chosen, choice.blocks, blocks), True)
    member = member[..., :blocks]
    union = member.view(batch, kv_heads, heads // kv_heads, blocks).any(2)
    current = choice.blocks[:, 0, -1]
    index = torch.arange(blocks, device=union.device).view(1, 1, -1)
    # The other blocks of the union ascending, then the rest; the current block (in every head's choice) last.
    key = torch.where(index == current.view(-1, 1, 1), 3 * blocks, torch.where(union, index, blocks + index))
    m = int(union.sum(-1).max())
    others = key.argsort(dim=-1)[..., : m - 1]
    picked = torch.cat([others, current.view(-1, 1, 1).expand(batch, kv_heads, 1)], dim=-1)
    chosen = union.gather(-1, picked)
    group = heads // kv_heads
    mine = member.gather(-1, picked.repeat_interleave(group, dim=1))
    return BlockChoice(picked, chosen), mine


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
