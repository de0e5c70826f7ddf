"""Low-precision K/V: int8 and int4 codes with a scale and a zero point per group (torch only).

As KIVI (Liu et al., 2024): keys per channel (their outliers sit in a few fixed channels), values per
token; one scale and zero point cover ``group_size`` numbers (values: consecutive channels of a token;
keys: one channel of up to ``group_size`` tokens, the caller's grouping). Default group size 32, or the
largest divisor of ``head_dim`` below it. Rounding is asymmetric min-max (``zero = min``, ``scale = (max -
min) / (2**bits - 1)``), with the statistics rounded to the K/V dtype *before* the codes are fitted; int4
codes are packed two per byte along ``head_dim``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.suggest.integers import check_int

__all__ = [
    "BITS",
    "DEFAULT_GROUP_SIZE",
    "QuantFormat",
    "default_group_size",
    "dequantize_channels",
    "dequantize_tokens",
    "pack",
    "quantize_channels",
    "quantize_tokens",
    "unpack",
]

BITS = (4, 8)
DEFAULT_GROUP_SIZE = 32


def default_group_size(head_dim: int) -> int:
    """The largest divisor of ``head_dim`` that is at most :data:`DEFAULT_GROUP_SIZE`."""
    return max(g for g in range(1, min(DEFAULT_GROUP_SIZE, head_dim) + 1) if head_dim % g == 0)


@dataclass(frozen=True)
class QuantFormat:
    """``bits`` per code (4 or 8) and ``group_size`` numbers per scale and zero point."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        check_int("group_size", self.group_size, 1)

    @property
    def levels(self) -> int:
        """The largest code: 255 for int8, 15 for int4."""
        return (1 << self.bits) - 1

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse a head_dim that the value groups do not tile, or that int4 cannot pack in pairs."""
        if head_dim % self.group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
            raise ValueError(
                f"group_size {self.group_size} does not divide head_dim {head_dim}; "
                f"allowed: {', '.join(map(str, divisors))}"
            )
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"int4 packs two codes per byte and needs an even head_dim, got {head_dim}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``[..., d]`` as stored: as they are for int8, two per byte for int4 ``[..., d/2]``
    (the even channel in the low nibble)."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``uint8`` codes ``[..., d]``."""
    if bits == 8:
        return packed
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def _fit(low: torch.Tensor, high: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """Scale and zero point for ranges ``[low, high]``, rounded to ``dtype``: ``[..., 2, n]``."""
    scale = ((high - low) / fmt.levels).to(dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    return torch.stack([scale, low.to(dtype)], dim=-2)


def _encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return ((x.float() - zero.float()) / scale.float()).round_().clamp_(0, fmt.levels).to(torch.uint8)


def quantize_tokens(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``x`` ``[..., d]`` in groups of ``group_size`` channels (values): the packed codes
    and the statistics ``[..., 2, d / group_size]`` (scale, zero point) in ``x``'s dtype."""
    groups = x.float().unflatten(-1, (-1, fmt.group_size))  # [..., d/G, G]
    stats = _fit(groups.amin(-1), groups.amax(-1), fmt, x.dtype)
    codes = _encode(groups, stats[..., 0, :, None], stats[..., 1, :, None], fmt).flatten(-2)
    return pack(codes, fmt.bits), stats


def dequantize_tokens(packed: torch.Tensor, stats: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`quantize_tokens` encoded, as ``dtype`` ``[..., d]``."""
    codes = unpack(packed, fmt.bits).float().unflatten(-1, (-1, fmt.group_size))
    stats = stats.float()
    return (codes * stats[..., 0, :, None] + stats[..., 1, :, None]).flatten(-2).to(dtype)


def quantize_channels(
    x: torch.Tensor, group: torch.Tensor, groups: int, fmt: QuantFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel quantization of ``x`` ``[n, slots, d]`` over groups of tokens (keys): ``group`` ``[n, slots]``
    is each token's group in ``[0, groups)``, ``groups`` itself none (meaningless codes, no statistics).
    Returns the packed codes and the statistics ``[n, groups, 2, d]`` in ``x``'s dtype."""
    n, slots, d = x.shape
    values = x.float()
    index = group.unsqueeze(-1).expand(n, slots, d)
    low = values.new_full((n, groups + 1, d), float("inf")).scatter_reduce(1, index, values, "amin")
    high = values.new_full((n, groups + 1, d), float("-inf")).scatter_reduce(1, index, values, "amax")
    empty = torch.isinf(low)  # groups without a member (and the outsiders' slot when unused)
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    stats = _fit(low, high, fmt, x.dtype)  # [n, groups + 1, 2, d]
    per_token = stats.gather(1, group.view(n, slots, 1, 1).expand(n, slots, 2, d))
    codes = _encode(values, per_token[..., 0, :], per_token[..., 1, :], fmt)
    return pack(codes, fmt.bits), stats[:, :groups]


def dequantize_channels(
    packed: torch.Tensor, stats: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Keys from codes ``[..., d]`` (packed) and each token's own group statistics ``[..., 2, d]``."""
    stats = stats.float()
    return (unpack(packed, fmt.bits).float() * stats[..., 0, :] + stats[..., 1, :]).to(dtype)
