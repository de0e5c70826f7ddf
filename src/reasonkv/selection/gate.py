"""SeerAttention-R's attention gate (decode): which blocks of the K/V cache a kv-head group should read.

The authors' gate (``seer_attn/decode_sparse/attn_gate_inf.py``: "Qproj" query pooling, keys pooled by
max, min and mean, RMSNorm on the gate's q and k as their training script turns on), per layer and kv-head
``k`` with query heads ``g`` of its group:

- the gate query: the group's pre-RoPE queries (after any q-norm), each projected by its own matrix and
  summed, ``q_k = sum_g W^q_{k,g} q_g`` (``gate_dim`` channels), RMS-normalised (a learned weight of
  ``gate_dim`` per layer, eps 1e-6; ``qk_norm``), then rotated by RoPE at the token's position (a RoPE of
  ``gate_dim`` channels with the model's base);
- the gate key of block ``j``: the block's pre-RoPE keys pooled by max, min and mean, concatenated
  (``3 * head_dim``), projected ``W^k_k`` (``gate_dim``), RMS-normalised likewise, rotated at the block's
  first position ``j * block_size`` (the authors rotate a block completed during decode at the position
  it was completed at; see ``docs/selection.md``);
- the block logits: ``q_k · K_{k,j} / sqrt(gate_dim)``, softmaxed over blocks by the policy.

The authors' width is 128 (from {64, 128, 256}) and their initialisation N(0, 0.02); ``init="xavier"``
is the Xavier-uniform their inference module's own constructor uses, kept as an option.

The pooled keys are kept incrementally as blocks fill (:class:`~reasonkv.selection.pooled.PooledKeys`);
the projection of a block is cheap enough to redo each step on the pooled side cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["GATE_DIM", "INITS", "GateShape", "SeerGate", "gate_rope", "rms_norm"]


GATE_DIM = 128  # the authors' gate width
INITS = ("normal", "xavier")
NORM_EPS = 1e-6


class GateShape:
    """What a gate was built for: layers, query and kv heads, head_dim, gate_dim, block_size, RoPE base, and
    whether the gate's q and k are RMS-normalised (``qk_norm``)."""

    FIELDS = ("layers", "heads", "kv_heads", "head_dim", "gate_dim", "block_size", "rope_base", "qk_norm")

    def __init__(
        self, layers, heads, kv_heads, head_dim, gate_dim=GATE_DIM, block_size=64, rope_base=10000.0, qk_norm=True
    ):
        self.layers, self.heads, self.kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.gate_dim, self.block_size, self.rope_base = gate_dim, block_size, float(rope_base)
        if not isinstance(qk_norm, bool):
            raise ValueError(f"gate qk_norm must be True or False, got {qk_norm!r}")
        self.qk_norm = qk_norm
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (the authors' RMSNorm, eps 1e-6)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


class SeerGate(nn.Module):
    """The gates of every layer: ``query[layer]`` ``[kv_heads, group, head_dim, gate_dim]``,
    ``key[layer]`` ``[kv_heads, 3 * head_dim, gate_dim]`` and, with ``qk_norm``, the RMSNorm weights
    ``query_norm[layer]``/``key_norm[layer]`` ``[gate_dim]`` (ones at first). ``init``: ``normal`` (default:
    N(0, 0.02), the authors' training initialisation) or ``xavier`` (Xavier-uniform)."""

    def __init__(self, shape: GateShape, seed: int = 0, init: str = "normal"):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"gate init must be one of {', '.join(INITS)}, got {init!r}")
        self.shape = shape
        generator = torch.Generator().manual_seed(seed)
        s = shape
        draw = _normal if init == "normal" else _xavier
        self.query = nn.ParameterList(
            [nn.Parameter(draw((s.kv_heads, s.group, s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )
        self.key = nn.ParameterList(
            [nn.Parameter(draw((s.kv_heads, 3 * s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )
        norms = s.layers if s.qk_norm else 0
        self.query_norm = nn.ParameterList([nn.Parameter(torch.ones(s.gate_dim)) for _ in range(norms)])
        self.key_norm = nn.ParameterList([nn.Parameter(torch.ones(s.gate_dim)) for _ in range(norms)])

    def gate_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``queries`` ``[batch, heads, n, head_dim]`` at ``positions`` ``[batch, n]`` ->
        ``[batch, kv_heads, n, gate_dim]``, rotated."""
        batch, heads, n, dim = queries.shape
        grouped = queries.float().view(batch, self.shape.kv_heads, self.shape.group, n, dim)
        projected = torch.einsum("bkgnd,kgdo->bkno", grouped, self.query[layer])
        if self.shape.qk_norm:
            projected = rms_norm(projected, self.query_norm[layer])
        return gate_rope(projected, positions.unsqueeze(1), self.shape.rope_base)

    def gate_keys(self, layer: int, maximum: torch.Tensor, minimum: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Pooled pre-RoPE keys ``[batch, kv_heads, blocks, head_dim]`` (max, min, mean) -> gate keys
        ``[batch, kv_heads, blocks, gate_dim]`` rotated at each block's first position."""
        pooled = torch.cat([maximum, minimum, mean], dim=-1).float()
        pooled = torch.where(torch.isfinite(pooled), pooled, 0.0)  # blocks with no token yet
        projected = torch.einsum("bknc,kco->bkno", pooled, self.key[layer])
        if self.shape.qk_norm:
            projected = rms_norm(projected, self.key_norm[layer])
        starts = torch.arange(pooled.shape[2], device=pooled.device) * self.shape.block_size
        return gate_rope(projected, starts, self.shape.rope_base)

    def logits(self, gate_queries: torch.Tensor, gate_keys: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, n, blocks]``: ``q · K / sqrt(gate_dim)`` (before the softmax over blocks)."""
        return gate_queries @ gate_keys.transpose(-1, -2) / math.sqrt(self.shape.gate_dim)


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * 0.02


def _xavier(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    fan_in, fan_out = shape[-2], shape[-1]
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
