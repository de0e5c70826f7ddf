"""A real EvictionView over fixed tensors (no model): for comparing a policy's scores with a reference
computed in the test from the paper's formula. Also the rotation the way transformers applies it
(``rotate_half`` with cos/sin tables), written out independently of reasonkv's rotary module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.recorded import Recorded
from reasonkv.policies.rotary import Rotary
from reasonkv.policies.view import EvictionView


def hf_tables(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., S, d]`` as transformers' Llama rotary module makes them."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def hf_rotate(x: torch.Tensor, inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``)."""
    cos, sin = hf_tables(inv_freq, scaling, positions)
    return x * cos + rotate_half(x) * sin


def hf_unrotate(x: torch.Tensor, inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> torch.Tensor:
    """The inverse, as the TriAttention authors write it: divide by the scaling, rotate by ``-angle``."""
    cos, sin = hf_tables(inv_freq, 1.0, positions)
    base = x / scaling
    return base * cos - rotate_half(base) * sin


@dataclass
class _Layer:
    keys: torch.Tensor
    values: torch.Tensor


class FixedCache:
    """The storage an EvictionView reads: one or more layers of keys/values at given logical positions."""

    def __init__(self, keys, values, positions, *, budget: int, valid=None, prompt: int = 1):
        self.layers = [_Layer(k, v) for k, v in zip(keys, values, strict=True)]
        self._positions = positions  # [rows, kv_heads, slots], the same in every layer
        rows, slots = positions.shape[0], positions.shape[-1]
        self.valid = valid if valid is not None else torch.ones(rows, slots, dtype=torch.bool)
        self.next_position = positions.amax(dim=(1, 2)) + 1
        self.prompt_lengths = torch.full((rows,), prompt)
        self.row_evictions = torch.zeros(rows, dtype=torch.long)
        self.budget = budget

    def positions(self, layer: int) -> torch.Tensor:
        return self._positions


def model_info(layers: int, heads: int, kv_heads: int, head_dim: int, rotary: Rotary | None) -> ModelInfo:
    return ModelInfo(layers, heads, kv_heads, head_dim, rotary=(rotary,) * layers, fingerprint="fixed")


def fixed_view(cache: FixedCache, policy, info: ModelInfo, *, recorded: Recorded | None = None, layer=0):
    rows = torch.arange(cache.valid.shape[0])
    view = EvictionView(
        cache=cache,
        recorded=recorded or Recorded(),
        policy=policy,
        rows=rows,
        row_seeds=torch.zeros_like(rows),
        info=info,
    )
    return view.at(layer)
