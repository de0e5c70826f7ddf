"""Training SeerAttention-R's gate by self-distillation: the frozen model's own block attention is the target.

For one sequence and one layer (the authors' recipe, ``attn_gate_training.py`` and the Qwen3 training
model): every query's attention over the keys (softmax of ``q · k * scaling``, causal) is max-pooled over
each block of ``block_size`` keys, then over the query heads of each kv-head group; the blocks a decode
step could choose (wholly before the query's own block) are kept and renormalised to sum to 1. The
gate's logits over the same blocks go through a log-softmax, and the loss is the KL divergence from the
target to the gate, averaged over queries and kv-heads. Queries in the first block have no block to
choose and are left out.

:func:`layer_example` turns the model's post-RoPE queries and keys of one sequence (and their pre-RoPE
values, what the gate reads) into what the loss needs; :func:`gate_loss` is that loss; :func:`train_gate`
runs Adam over examples. Torch only: the model is run elsewhere (:mod:`reasonkv.calibrate.gates`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reasonkv.selection.gate import SeerGate

__all__ = ["LayerExample", "block_pool", "block_targets", "gate_loss", "layer_example", "train_gate"]


@dataclass
class LayerExample:
    """One sequence's training material for one layer: the gate's inputs and the target.

    ``queries`` ``[heads, n, head_dim]`` pre-RoPE at ``positions`` ``[n]``; ``maximum``/``minimum``/``mean``
    ``[kv_heads, blocks, head_dim]`` the pooled pre-RoPE keys; ``target`` ``[kv_heads, n, blocks]``;
    ``visible`` ``[n, blocks]``.
    """

    layer: int
    queries: torch.Tensor
    positions: torch.Tensor
    maximum: torch.Tensor
    minimum: torch.Tensor
    mean: torch.Tensor
    target: torch.Tensor
    visible: torch.Tensor
    quest: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # post-RoPE queries, key min, key max


def block_pool(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Max, min and mean of ``keys`` ``[kv_heads, length, dim]`` per block: ``[kv_heads, blocks, dim]`` each."""
    heads, length, dim = keys.shape
    blocks = -(-length // block_size)
    pad = blocks * block_size - length
    k = keys.float()
    high = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("-inf")).view(heads, blocks, block_size, dim)
    low = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("inf")).view(heads, blocks, block_size, dim)
    total = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(heads, blocks, block_size, dim).sum(2)
    counts = torch.full((blocks,), float(block_size))
    counts[-1] = block_size - pad
    return high.amax(2), low.amin(2), total / counts.view(1, -1, 1).to(total.device)


def block_targets(
    queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scaling: float, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target ``[kv_heads, n, blocks]`` and which blocks each query may choose ``[n, blocks]``, for the
    queries at positions ``rows`` ``[n]`` of post-RoPE ``queries`` ``[heads, length, head_dim]`` against
    post-RoPE ``keys`` ``[kv_heads, length, head_dim]``."""
    heads, length, _ = queries.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    expanded = keys.float().repeat_interleave(group, dim=0)
    logits = queries[:, rows].float() @ expanded.transpose(-1, -2) * scaling  # [heads, n, length]
    causal = torch.arange(length, device=rows.device).view(1, -1) <= rows.view(-1, 1)
    attention = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    blocks = -(-length // block_size)
    pad = blocks * block_size - length
    pooled = torch.nn.functional.pad(attention, (0, pad)).view(heads, len(rows), blocks, block_size).amax(-1)
    pooled = pooled.view(kv_heads, group, len(rows), blocks).amax(1)
    visible = torch.arange(blocks, device=rows.device).view(1, -1) < (rows // block_size).view(-1, 1)
    pooled = pooled * visible
    return pooled / pooled.sum(-1, keepdim=True).clamp(min=1e-12), visible


def layer_example(
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    queries_before: torch.Tensor,
    keys_before: torch.Tensor,
    rows: torch.Tensor,
    scaling: float,
    block_size: int,
) -> LayerExample:
    """One layer's example from its post-RoPE ``queries`` ``[heads, length, d]``/``keys`` ``[kv_heads, length, d]``
    and their pre-RoPE values, for the query positions ``rows`` (each at least ``block_size``)."""
    target, visible = block_targets(queries, keys, rows, scaling, block_size)
    maximum, minimum, mean = block_pool(keys_before, block_size)
    return LayerExample(layer, queries_before[:, rows].float(), rows, maximum, minimum, mean, target, visible)


def gate_loss(gate: SeerGate, example: LayerExample) -> torch.Tensor:
    """KL(target || gate) of one example, averaged over its queries and kv-heads."""
    gate_queries = gate.gate_queries(example.layer, example.queries.unsqueeze(0), example.positions.unsqueeze(0))
    gate_keys = gate.gate_keys(
        example.layer, example.maximum.unsqueeze(0), example.minimum.unsqueeze(0), example.mean.unsqueeze(0)
    )
    logits = gate.logits(gate_queries, gate_keys)[0]  # [kv_heads, n, blocks]
    log_p = logits.masked_fill(~example.visible, float("-inf")).log_softmax(dim=-1)
    target = example.target
    terms = torch.xlogy(target, target) - target * log_p.masked_fill(~example.visible, 0.0)
    return terms.sum(-1).mean()


def train_gate(
    gate: SeerGate,
    examples: Sequence[Sequence[LayerExample]],
    *,
    steps: int,
    lr: float = 1e-3,
    on_step: Callable[[int, float], None] | None = None,
    seed: int = 0,
) -> list[float]:
    """Adam on the gate over ``examples`` (per sequence, one example per layer), one sequence per step in a
    seeded shuffled order; returns the loss (summed over layers) of every step."""
    if not examples:
        raise ValueError("gate training needs at least one sequence")
    optimizer = torch.optim.Adam(gate.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses = []
    for step in range(steps):
        if not order:
            order = torch.randperm(len(examples), generator=generator).tolist()
        sequence = examples[order.pop()]
        optimizer.zero_grad()
        loss = sum(gate_loss(gate, example) for example in sequence)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def mean_loss(gate: SeerGate, examples: Sequence[Sequence[LayerExample]]) -> float:
    """The loss summed over layers, averaged over sequences (no gradient)."""
    with torch.no_grad():
        return sum(float(sum(gate_loss(gate, e) for e in sequence)) for sequence in examples) / len(examples)
