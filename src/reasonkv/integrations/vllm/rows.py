"""One request's tokens as reasonkv reads them: a one-row cache without padding, with the keys, positions and
validity the observer (:class:`reasonkv.cache.observe.Observer`) reads and the policy's ``EvictionView`` is built
over (:mod:`reasonkv.policies.view`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.recorded import Recorded
from reasonkv.policies.rotary import Rotary
from reasonkv.policies.view import EvictionView

__all__ = ["RequestCache", "kept_indices", "rotary_of"]

# layer, held tokens -> (keys, values) [kv_heads, held, head_dim] of the request's first ``held`` tokens
Reader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class RequestCache:
    """The tokens a request holds, every layer, as a one-row cache. ``held_positions`` ``[layers, kv_heads, held]``
    are their logical positions; their keys and values are read from the request's blocks when asked for (once
    per layer until the request's tokens change: the observer's flush and the eviction read the same ones)."""

    maybe_padded = False  # one request, no padding
    allocated = False  # every head holds the same tokens (a vLLM block holds all heads)

    def __init__(self, read: Reader, info: ModelInfo, kv_heads: int, budget: int):
        self._read = read
        self.full_layers = info.full_layers
        self.budget = budget
        self.held_positions = torch.empty(info.num_layers, kv_heads, 0, dtype=torch.long)
        self.seen = 0  # logical tokens so far: every position is below it
        self.prompt = 0
        self.evictions = 0
        self._dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- as the request changes
    @property
    def held(self) -> int:
        return self.held_positions.shape[-1]

    def grow(self, new: int) -> None:
        """A forward of ``new`` tokens begins: they are held from now on (as reasonkv's storage grows before its
        attention runs), at the next logical positions."""
        layers, heads, _ = self.held_positions.shape
        arriving = torch.arange(self.seen, self.seen + new).view(1, 1, -1).expand(layers, heads, -1)
        self.held_positions = torch.cat([self.held_positions, arriving], dim=-1)
        self.seen += new
        self._dense = {}

    def keep(self, kept: torch.Tensor) -> None:
        """An eviction kept the slots ``kept`` ``[layers, kv_heads, K]``, now written first in the blocks."""
        self.held_positions = self.held_positions.gather(-1, kept)
        self.evictions += 1
        self._dense = {}

    # ---------------------------------------------------------------- what the observer reads
    @property
    def valid(self) -> torch.Tensor:
        return torch.ones(1, self.held, dtype=torch.bool)

    def key_valid(self, layer: int) -> torch.Tensor:
        return self.valid

    def positions(self, layer: int) -> torch.Tensor:
        return self.held_positions[layer].unsqueeze(0)

    def attended(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        dense = self._dense.get(layer)
        if dense is None:
            keys, values = self._read(layer, self.held)
            dense = self._dense[layer] = (keys.unsqueeze(0), values.unsqueeze(0))
        return dense

    # ---------------------------------------------------------------- what the policy's view reads
    @property
    def next_position(self) -> torch.Tensor:
        return torch.tensor([self.seen])

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([self.prompt])

    @property
    def row_evictions(self) -> torch.Tensor:
        return torch.tensor([self.evictions])


def kept_indices(policy, cache: RequestCache, info: ModelInfo, recorded: Recorded, seed: torch.Tensor) -> torch.Tensor:
    """The slots each layer and head keeps, ``[layers, kv_heads, K]`` in the order the tokens came, chosen by the
    policy's own ``keep`` (token granularity: one set for every layer and head) or ``keep_layers`` (per head)."""
    rows = torch.tensor([0])
    view = EvictionView(cache=cache, recorded=recorded, policy=policy, rows=rows, row_seeds=seed, info=info)
    layers, heads, _ = cache.held_positions.shape
    if policy.granularity == "token":
        kept = policy.keep(view)[0]  # [K]
        kept = kept.view(1, 1, -1).expand(layers, heads, -1)
    else:
        kept = torch.stack([k[0] for k in policy.keep_layers(view)])  # [layers, kv_heads, K]
    return kept.sort(dim=-1).values


def rotary_of(layer: torch.nn.Module, head_dim: int) -> Rotary:
    """A decoder layer's rotation as reasonkv's policies read it, from the rotary module vLLM applies in it: its
    frequencies as vLLM computes them and its pairing (neox style: halves). Only vLLM's plain ``RotaryEmbedding``
    (the default type, no scaling) is read; another is refused by the policies that rotate keys back."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase

    modules = [m for m in layer.modules() if isinstance(m, RotaryEmbeddingBase)]
    if len(modules) != 1 or type(modules[0]) is not RotaryEmbedding:
        kinds = ", ".join(type(m).__name__ for m in modules) or "none"
        refused = f"reasonkv reads vLLM's plain RotaryEmbedding only (this layer's rotary modules: {kinds})"
        return Rotary("unknown", head_dim=head_dim, refused=refused)
    module = modules[0]
    frequencies = module._compute_inv_freq(module.base).float()
    pairing = "half" if module.is_neox_style else "interleaved"
    return Rotary("default", tuple(frequencies.tolist()), 1.0, pairing, module.head_size)
