"""A request's K/V in vLLM's paged cache, read out densely for a policy and written back compacted.

The layout inside a block is the attention backend's business, so rather than copy its rules (and corrupt the
cache silently when a release changes them) it is learned once from the backend's own write op: probe values
whose token and channel can be read back, and where each landed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BlockLayout", "probe_layout"]

# Probe digits stay below 64 so that every cache dtype (bf16 holds integers exactly up to 256) stores them exactly.
_DIGIT = 64

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class BlockLayout:
    """Where token ``t``, channel ``j`` of one head lies in a block: ``keys[t, j]`` and ``values[t, j]`` are flat
    offsets into that head's ``2 * block_size * head_dim`` numbers (the blocks are ``[blocks, kv_heads, ...]``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.block_size, self.head_dim = keys.shape

    def _where(self, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """The ``blocks`` that hold the first ``length`` tokens and, per token, its block among them ``[length, 1]``
        and its key and value offsets ``[length, dim]``."""
        slot = torch.arange(length)
        token = slot % self.block_size
        used = blocks[: -(-length // self.block_size)]
        return used, (slot // self.block_size).unsqueeze(1), self.keys[token], self.values[token]

    def read(self, cache: torch.Tensor, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens held in ``blocks``, in order: keys, values ``[kv_heads, length, head_dim]``."""
        used, block, key, value = self._where(blocks, length)
        flat = cache.index_select(0, used).flatten(2).transpose(1, 2)  # [used, area, kv_heads]
        return flat[block, key].permute(2, 0, 1), flat[block, value].permute(2, 0, 1)

    def write(self, cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys`` and ``values`` ``[kv_heads, n, head_dim]`` as the first ``n`` tokens of ``blocks``."""
        used, block, key, value = self._where(blocks, keys.shape[1])
        raw = cache.index_select(0, used)  # the blocks as they are: a partial last block keeps its tail
        flat = raw.flatten(2).transpose(1, 2)  # a view of raw: [used, area, kv_heads]
        flat[block, key] = keys.permute(1, 2, 0).to(cache.dtype)
        flat[block, value] = values.permute(1, 2, 0).to(cache.dtype)
        cache.index_copy_(0, used, raw)


def probe_layout(write: Writer, block_size: int, head_dim: int, dtype: torch.dtype) -> BlockLayout:
    """Learn a block's layout from ``write(keys, values, block, slots)``, the backend's own op that stores
    ``[tokens, kv_heads, head_dim]`` keys and values at ``slots`` of ``block`` ``[1, 1, block_size, 2 * head_dim]``."""
    tokens = torch.arange(block_size).view(-1, 1).expand(block_size, head_dim)
    channels = torch.arange(head_dim).view(1, -1).expand(block_size, head_dim)
    digits = []
    for number in (tokens, channels):
        for part in (number % _DIGIT, number // _DIGIT):
            block = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
            probe = (part + 1).to(dtype).unsqueeze(1)  # +1: an unwritten number reads 0
            write(probe, -probe, block, torch.arange(block_size))
            digits.append(block.flatten().float())
    found = digits[0].abs() > 0
    if not bool(found.all()):
        raise RuntimeError("reasonkv: the attention backend's write op left part of a block unwritten; layout unknown")
    token = (digits[0].abs() - 1) + (digits[1].abs() - 1) * _DIGIT
    channel = (digits[2].abs() - 1) + (digits[3].abs() - 1) * _DIGIT
    is_key = digits[0] > 0
    offsets = torch.arange(token.numel())
    maps = []
    for side in (is_key, ~is_key):
        table = torch.full((block_size, head_dim), -1, dtype=torch.long)
        table[token[side].long(), channel[side].long()] = offsets[side]
        if bool((table < 0).any()):
            raise RuntimeError("reasonkv: the attention backend's block layout could not be read back")
        maps.append(table)
    return BlockLayout(*maps)
