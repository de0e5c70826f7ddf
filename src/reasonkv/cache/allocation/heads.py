"""Heads that hold different numbers of tokens, read as one dense slot axis (torch only): each head's tokens
right-aligned, its first slots padding (position ``-1``)."""

from __future__ import annotations

import torch

__all__ = ["head_mask", "widest_positions"]


def head_mask(positions: torch.Tensor, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of one layer's forward, ``[batch, heads, q, slots]`` (``0`` visible, the
    dtype's lowest number hidden), from the layer's ``positions`` ``[batch, kv_heads, slots]`` read after the
    forward's write (the ``q`` new tokens last): query ``i`` sees the slots its head holds a token at (``-1``:
    padding of the row, of the head, or an incoming padding token), up to its own. A padding query's row hides
    everything; the kernel's softmax over the lowest number stays finite there."""
    batch, kv_heads, slots = positions.shape
    q, heads = query.shape[2], query.shape[1]
    newest = slots - q + torch.arange(q, device=positions.device)
    causal = torch.arange(slots, device=positions.device).view(1, -1) <= newest.view(-1, 1)  # [q, slots]
    held = (positions >= 0).repeat_interleave(heads // kv_heads, dim=1)  # [batch, heads, slots]
    visible = held.unsqueeze(2) & causal
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def widest_positions(layers: list[torch.Tensor]) -> torch.Tensor:
    """``[batch, slots]``: the positions of each row's widest head (the most tokens) among the layers'
    ``[batch, kv_heads, slots]`` positions."""
    best, most = None, None
    for positions in layers:
        counts, head = (positions >= 0).sum(-1).max(-1)  # [batch]
        chosen = positions.gather(1, head.view(-1, 1, 1).expand(-1, 1, positions.shape[-1])).squeeze(1)
        if best is None:
            best, most = chosen, counts
            continue
        wider = counts > most
        best, most = torch.where(wider.unsqueeze(-1), chosen, best), torch.where(wider, counts, most)
    return best
