"""The policy contract: what a policy declares it reads, what one forward pass hands it, and the
model facts it may use. Torch only, no engine import: a serving engine that reuses ``policies/``
builds these same objects from its own model runner.

What a policy may read at eviction time is :class:`reasonkv.view.EvictionView`; the attention
recompute maths is :mod:`reasonkv.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LAYER_KINDS", "ModelInfo", "Needs", "Step"]

# What a decoder layer keeps: "full" attention (the layers a policy evicts in), a "sliding" window,
# "chunked" attention (a window that restarts at chunk boundaries), or "linear" attention / other
# recurrent state with no per-token K/V.
LAYER_KINDS = ("full", "sliding", "chunked", "linear")


@dataclass(frozen=True)
class ModelInfo:
    """The attention shape of a model.

    ``layer_kinds`` names each decoder layer's kind (see ``LAYER_KINDS``); empty means every layer
    is full attention.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers, the ones a policy evicts in (every layer of a plain model).

        Sliding-window layers keep their model's window and linear-attention layers their state, so
        per-layer scores, kept sets and attention signals exist for these layers only.
        """
        return tuple(i for i in range(self.num_layers) if self.kind(i) == "full")


@dataclass(frozen=True)
class Needs:
    """What a policy reads. Nothing else is recorded."""

    hidden_layers: tuple[int, ...] = ()  # residual-stream outputs of these decoder layers
    query_window: int = 0  # keep the most recent `query_window` post-RoPE queries of every layer
    attention_last: bool = False  # attention row of each forward's newest query, every layer
    attention_sum: bool = False  # attention column sums over all queries of each forward, every layer

    @property
    def taps_attention(self) -> bool:
        return self.query_window > 0 or self.attention_last or self.attention_sum


@dataclass
class Step:
    """What one forward pass (a prefill or a decode step) produced, handed to ``Policy.observe``.

    Attention tensors are ``[batch, query_heads, slots]`` over the slots stored during that
    forward (the cache layout before any eviction that follows it); padding slots get 0.
    """

    input_valid: torch.Tensor  # [batch, q] real (True) vs padding tokens of this forward
    input_positions: torch.Tensor  # [batch, q] their logical positions (-1 for padding)
    slot_positions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, kv_heads, slots]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, q, hidden]
    attention_last: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_sum: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return self.input_valid.shape[1] > 1
