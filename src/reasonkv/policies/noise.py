"""Random numbers keyed by what they are for, not drawn from a stream. Torch only.

Every number is a hash of integer keys (a row's seed, which eviction and layer, a head, a token's
logical position, ...), computed with 64-bit integer arithmetic (splitmix64). So:

- a row's draws depend only on its own seed and keys, never on the batch around it or on padding
  (keys are logical positions, not slots): a prompt makes the same random choices in a batch as alone;
- the same keys give the same numbers on every device (CPU and CUDA agree bit for bit);
- drawing needs no per-row loop, generator object or host synchronisation: one vectorised op.
"""

from __future__ import annotations

import math

import torch

from reasonkv.suggest.integers import is_int

__all__ = ["gumbel", "mix", "normal", "seed_tensor", "uniform"]

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants as signed 64-bit integers
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` on a signed tensor keeps the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def mix(key: torch.Tensor | int, *more: torch.Tensor | int) -> torch.Tensor:
    """One 64-bit hash of several integer keys (tensors broadcast together)."""
    h = _splitmix(torch.as_tensor(key, dtype=torch.int64))
    for k in more:
        h = _splitmix(h ^ torch.as_tensor(k, dtype=torch.int64, device=h.device))
    return h


def seed_tensor(seed: int | list[int], batch: int, device: torch.device | str) -> torch.Tensor:
    """Per-row seeds ``[batch]`` (int64) from one seed for all rows or one per row."""
    seeds = [seed] * batch if is_int(seed) else list(seed)
    if len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for a batch of {batch}")
    return torch.tensor([int(s) for s in seeds], dtype=torch.int64, device=device)


def uniform(hashed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform numbers in (0, 1) from hashes (``float64`` keeps 53 bits, other dtypes 24)."""
    if dtype == torch.float64:
        return (_shr(hashed, 11).double() + 0.5) / float(1 << 53)
    return ((_shr(hashed, 40).to(torch.float32) + 0.5) / float(1 << 24)).to(dtype)


def gumbel(hashed: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from hashes, float32."""
    return -torch.log(-torch.log(uniform(hashed)))


def normal(seeds: torch.Tensor, shape: tuple[int, ...], stream: int = 0) -> torch.Tensor:
    """Standard normal numbers ``[len(seeds), *shape]``, float32; row ``i`` depends on ``seeds[i]`` alone.

    Box-Muller on two uniforms per number, keyed by the number's flat index.
    """
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int64, device=seeds.device)
    base = mix(seeds, stream).unsqueeze(1)
    u1 = uniform(mix(base, 2 * index))
    u2 = uniform(mix(base, 2 * index + 1))
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return z.view(len(seeds), *shape)
