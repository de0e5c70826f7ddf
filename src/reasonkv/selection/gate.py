"""SeerAttention-R's attention gate (decode): which blocks of the K/V cache a kv-head group should read.

As the authors define it (``seer_attn/decode_sparse``, "Qproj" query pooling, keys pooled by max, min and
mean), per layer and kv-head ``k`` with query heads ``g`` of its group:

- the gate query: the group's pre-RoPE queries (after any q-norm), each projected by its own matrix and
  summed, ``q_k = sum_g W^q_{k,g} q_g`` (``gate_dim`` channels), then rotated by RoPE at the token's
  position (a RoPE of ``gate_dim`` channels with the model's base);
- the gate key of block ``j``: the block's pre-RoPE keys pooled by max, min and mean, concatenated
  (``3 * head_dim``), projected ``W^k_k`` (``gate_dim``), rotated at the block's first position ``j * block_size``;
- the block scores: ``softmax_j(q_k · K_{k,j} / sqrt(gate_dim))`` over the blocks the query may read.

The pooled keys are kept incrementally as blocks fill (:class:`~reasonkv.selection.pooled.PooledKeys`);
the projection of a block is cheap enough to redo each step on the pooled side cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["GateShape", "SeerGate", "gate_rope"]


class GateShape:
    """What a gate was built for: layers, query and kv heads, head_dim, gate_dim, block_size, RoPE base."""

    FIELDS = ("layers", "heads", "kv_heads", "head_dim", "gate_dim", "block_size", "rope_base")

    def __init__(self, layers, heads, kv_heads, head_dim, gate_dim=32, block_size=64, rope_base=10000.0):
        self.layers, self.heads, self.kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.gate_dim, self.block_size, self.rope_base = gate_dim, block_size, float(rope_base)
        for name in ("layers", "heads", "kv_heads", "head_dim", "gate_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"gate {name} must be a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"gate heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if gate_dim % 2:
            raise ValueError(f"gate_dim must be even (RoPE rotates channel pairs), got {gate_dim}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}


def gate_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (half pairing, as transformers' ``rotate_half``) of ``x`` ``[..., n, dim]`` at ``positions``
    (broadcast to ``[..., n]``), in float32."""
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : dim // 2].float(), x[..., dim // 2 :].float()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class SeerGate(nn.Module):
    """The gates of every layer: ``query[layer]`` ``[kv_heads, group, head_dim, gate_dim]`` and
    ``key[layer]`` ``[kv_heads, 3 * head_dim, gate_dim]`` (Xavier-uniform at first, as the authors')."""

    def __init__(self, shape: GateShape, seed: int = 0):
        super().__init__()
        self.shape = shape
        generator = torch.Generator().manual_seed(seed)
        s = shape
        self.query = nn.ParameterList(
            [nn.Parameter(_xavier((s.kv_heads, s.group, s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )
        self.key = nn.ParameterList(
            [nn.Parameter(_xavier((s.kv_heads, 3 * s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )

    def gate_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``queries`` ``[batch, heads, n, head_dim]`` at ``positions`` ``[batch, n]`` ->
        ``[batch, kv_heads, n, gate_dim]``, rotated."""
        batch, heads, n, dim = queries.shape
        grouped = queries.float().view(batch, self.shape.kv_heads, self.shape.group, n, dim)
        projected = torch.einsum("bkgnd,kgdo->bkno", grouped, self.query[layer])
        return gate_rope(projected, positions.unsqueeze(1), self.shape.rope_base)

    def gate_keys(self, layer: int, maximum: torch.Tensor, minimum: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Pooled pre-RoPE keys ``[batch, kv_heads, blocks, head_dim]`` (max, min, mean) -> gate keys
        ``[batch, kv_heads, blocks, gate_dim]`` rotated at each block's first position."""
        pooled = torch.cat([maximum, minimum, mean], dim=-1).float()
        pooled = torch.where(torch.isfinite(pooled), pooled, 0.0)  # blocks with no token yet
        projected = torch.einsum("bknc,kco->bkno", pooled, self.key[layer])
        starts = torch.arange(pooled.shape[2], device=pooled.device) * self.shape.block_size
        return gate_rope(projected, starts, self.shape.rope_base)

    def logits(self, gate_queries: torch.Tensor, gate_keys: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, n, blocks]``: ``q · K / sqrt(gate_dim)`` (before the softmax over blocks)."""
        return gate_queries @ gate_keys.transpose(-1, -2) / math.sqrt(self.shape.gate_dim)


def _xavier(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    fan_in, fan_out = shape[-2], shape[-1]
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
