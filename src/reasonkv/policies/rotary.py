"""A layer's rotary position embedding as data, to rotate cached keys and recorded queries back to their
pre-RoPE values (torch only: the transformers binding fills it in, :mod:`reasonkv.hf.rotary`).

RoPE turns channel pair ``f`` of a vector at position ``p`` into ``s · e^{i ω_f p} · x_f`` (``s`` the scaling
YaRN-style types fold into their tables). Scaled types (linear, Llama 3, YaRN) fix ``ω`` and ``s`` once the
model is built, so ``e^{-i ω_f p} / s`` undoes it exactly; ``dynamic`` and ``longrope`` depend on the
sequence length and are refused (:attr:`Rotary.refused`). Pairs are formed the model's way (``"half"``:
``j`` with ``j + r/2``, transformers' ``rotate_half``; ``"interleaved"``: ``2j`` with ``2j + 1``); channels
beyond the rotary dimension pass through, paired half-style as frequency-0 pairs with scaling 1. Angles are
formed in float32, as transformers forms them, so undoing a rotation uses the angle that made it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PAIRINGS", "Rotary", "RotaryTables"]

PAIRINGS = ("half", "interleaved")


@dataclass(frozen=True)
class Rotary:
    """How one layer's queries and keys were rotated."""

    kind: str  # the model's name for its rotary type ("default", "llama3", "yarn", ...)
    inv_freq: tuple[float, ...] = ()  # ω_f of each rotary pair, as the model holds them (float32); empty when refused
    scaling: float = 1.0  # the attention scaling s multiplied into the cos/sin tables (1 for most types)
    pairing: str = "half"  # or "interleaved"
    head_dim: int = 0  # channels per head (rotary and passed through)
    refused: str = ""  # why this rotation cannot be undone (empty: it can)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def pair_count(self) -> int:
        """Channel pairs of a head: the rotary ones, then the pass-through ones."""
        return self.head_dim // 2

    def check(self, who: str) -> None:
        """Raise ``ValueError`` naming ``who`` and the rotary type when the rotation cannot be undone."""
        if self.refused:
            raise ValueError(f"{who}: cannot rotate keys back to pre-RoPE space: {self.refused}")
        if (self.head_dim - self.rotary_dim) % 2:
            raise ValueError(
                f"{who}: {self.head_dim - self.rotary_dim} channels pass through the rotary embedding "
                "unrotated, an odd number that cannot be paired"
            )

    def tables(self, device=None) -> RotaryTables:
        """The rotation as tensors on ``device`` (made once, e.g. when a generation starts: building them
        copies host data to the device)."""
        return RotaryTables(self, device)


class RotaryTables:
    """A :class:`Rotary` as tensors on one device: complex pairs, phases, rotation and its inverse.

    ``omega`` and ``scale`` hold ``ω`` and ``s`` of every pair, ``[head_dim / 2]`` float32: the rotary
    pairs first, then the pass-through pairs (``ω = 0``, ``s = 1``).
    """

    def __init__(self, rotary: Rotary, device=None):
        self.rotary = rotary
        self.count = len(rotary.inv_freq)
        self.inv_freq = torch.tensor(rotary.inv_freq, dtype=torch.float32, device=device)
        rest = rotary.pair_count - self.count
        self.omega = torch.cat([self.inv_freq, self.inv_freq.new_zeros(rest)])
        self.scale = torch.cat([torch.full_like(self.inv_freq, rotary.scaling), self.inv_freq.new_ones(rest)])

    # -- channels <-> complex pairs -----------------------------------------------------------------
    def pairs(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., head_dim]`` real -> ``[..., head_dim / 2]`` complex64 pairs (rotary first, then pass-through)."""
        x = x.float()
        r, d = self.rotary.rotary_dim, self.rotary.head_dim
        if self.rotary.pairing == "half":
            real, imag = [x[..., : r // 2]], [x[..., r // 2 : r]]
        else:
            real, imag = [x[..., 0:r:2]], [x[..., 1:r:2]]
        rest = (d - r) // 2
        real.append(x[..., r : r + rest])
        imag.append(x[..., r + rest :])
        return torch.complex(torch.cat(real, dim=-1), torch.cat(imag, dim=-1))

    def channels(self, z: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`pairs`: ``[..., head_dim / 2]`` complex -> ``[..., head_dim]`` float32."""
        rotary, passing = z[..., : self.count], z[..., self.count :]
        if self.rotary.pairing == "half":
            rotated = torch.cat([rotary.real, rotary.imag], dim=-1)
        else:
            rotated = torch.stack([rotary.real, rotary.imag], dim=-1).flatten(-2)
        return torch.cat([rotated, passing.real, passing.imag], dim=-1)

    # -- rotation -----------------------------------------------------------------------------------
    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``ω_f p`` of the rotary pairs, ``[..., rotary_dim / 2]``, in float32 as transformers computes them."""
        return positions.float().unsqueeze(-1) * self.inv_freq

    def phases(self, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """The complex factor of every pair at ``positions``: ``s e^{i ω p}`` (``inverse``: ``e^{-i ω p} / s``)
        for rotary pairs, 1 for pass-through ones; ``[..., head_dim / 2]`` complex64."""
        angles = self.angles(positions)
        magnitude = 1.0 / self.rotary.scaling if inverse else self.rotary.scaling
        rotary = torch.polar(torch.full_like(angles, magnitude), -angles if inverse else angles)
        ones = rotary.new_ones((*angles.shape[:-1], self.rotary.pair_count - self.count))
        return torch.cat([rotary, ones], dim=-1)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply the rotation: ``x [..., S, head_dim]`` at ``positions [..., S]`` (broadcast), float32."""
        return self.channels(self.pairs(x) * self.phases(positions))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the rotation of ``x [..., S, head_dim]`` made at ``positions [..., S]``: pre-RoPE values, float32."""
        return self.channels(self.pairs(x) * self.phases(positions, inverse=True))
