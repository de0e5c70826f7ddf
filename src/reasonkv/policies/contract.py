"""The policy contract: what a policy declares it reads, what one forward pass hands it, and the
model facts it may use. Torch only, no engine import: a serving engine that reuses ``policies/``
builds these same objects from its own model runner.

What a policy may read at eviction time is :class:`reasonkv.policies.view.EvictionView`; the attention
recompute maths is :mod:`reasonkv.policies.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reasonkv.policies.rotary import Rotary

__all__ = ["LAYER_KINDS", "AttentionChunk", "ModelInfo", "Needs", "Step"]

# What a decoder layer keeps: "full" attention (the layers a policy evicts in), a "sliding" window,
# "chunked" attention (a window that restarts at chunk boundaries), or "linear" attention / other
# recurrent state with no per-token K/V.
LAYER_KINDS = ("full", "sliding", "chunked", "linear")


@dataclass(frozen=True)
class ModelInfo:
    """The attention shape of a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...] = ()  # each decoder layer's kind (LAYER_KINDS); empty: every layer is full
    # Each layer's rotary embedding, what a policy needs to rotate keys or queries back to pre-RoPE space
    # (None for a layer without one; empty when unknown, e.g. built from a config alone).
    rotary: tuple[Rotary | None, ...] = ()
    # The weights' identity: a hash of a sample of every parameter, the same in every dtype (empty when
    # unknown), so that a file computed on one model is not used with another.
    fingerprint: str = ""

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers, the ones a policy evicts in (every layer of a plain model).

        Sliding-window layers keep their model's window and linear-attention layers their state, so
        per-layer scores, kept sets and attention signals exist for these layers only.
        """
        return tuple(i for i in range(self.num_layers) if self.kind(i) == "full")

    def rotary_of(self, layer: int, who: str) -> Rotary:
        """Layer ``layer``'s rotary embedding; ``ValueError`` naming ``who`` when it is unknown or cannot be undone."""
        rotary = self.rotary[layer] if layer < len(self.rotary) else None
        if rotary is None:
            raise ValueError(f"{who}: the rotary embedding of layer {layer} is unknown, so keys cannot be rotated back")
        rotary.check(who)
        return rotary


@dataclass(frozen=True)
class Needs:
    """What a policy reads; nothing else is recorded.

    ``attention_last`` and ``attention_sum`` reach ``Policy.observe_attention`` as :class:`AttentionChunk` s,
    recomputed from the recorded queries in one batched pass before the next eviction: keys are only
    appended in between, so this is exactly the attention each query had.
    """

    hidden_layers: tuple[int, ...] = ()  # residual-stream outputs of these decoder layers
    query_window: int = 0  # keep the most recent `query_window` post-RoPE queries of every layer
    attention_last: bool = False  # attention row of each forward's newest query, every layer
    attention_sum: bool = False  # attention each stored key received from every query, every layer
    queries: bool = False  # every forward's post-RoPE queries, handed to ``Policy.observe_queries``

    @property
    def taps_attention(self) -> bool:
        return self.query_window > 0 or self.attention_last or self.attention_sum or self.queries


@dataclass
class Step:
    """What one forward pass (a prefill or a decode step) produced, handed to ``Policy.observe``."""

    input_valid: torch.Tensor  # [batch, q] real (True) vs padding tokens of this forward
    input_positions: torch.Tensor  # [batch, q] their logical positions (-1 for padding)
    position_bound: int = 0  # every logical position seen so far is below this (sizes tables, no device read)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, q, hidden]


@dataclass
class AttentionChunk:
    """Recomputed attention of some recorded queries over one layer's stored keys.

    Queries are in the order they came (oldest first). ``rows`` are present when the policy needs
    ``attention_last`` (each query was the newest of its forward), ``column_sums`` when it needs
    ``attention_sum``. Padding keys and padding queries carry zero attention.
    """

    layer: int
    slot_positions: torch.Tensor  # [batch, kv_heads, slots] logical positions of the stored keys (-1: padding)
    query_positions: torch.Tensor  # [batch, n] logical positions of the queries (-1: padding)
    visible: torch.Tensor | None  # [batch, n, slots] the keys each query could see (with ``rows``)
    position_bound: int  # every position in this chunk is below it
    rows: torch.Tensor | None = None  # [batch, query_heads, n, slots] softmax rows
    column_sums: torch.Tensor | None = None  # [batch, query_heads, slots] rows summed over the valid queries
