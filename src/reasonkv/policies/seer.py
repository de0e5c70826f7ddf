"""SeerAttention-R (Gao et al., "SeerAttention-R: Sparse Attention Adaptation for Long Reasoning", 2025): a
small trained gate chooses, per kv-head group and decode step, the blocks of the K/V cache to read. A
selection policy: the cache holds every token."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.options import check_at_least
from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.gatefile import GateFile, check_gate, load_gate
from reasonkv.selection.pooled import PooledKeys

__all__ = ["GATE_FILE", "Seer", "bundled_gate"]

BUNDLED = ("reasonkv", "data", "gates")  # package folder of the bundled models' gate files
GATE_FILE = "gates.pt"  # the name reasonkv calibrate --gates writes in its folder


def bundled_gate(info: ModelInfo, who: str) -> tuple[GateFile, str]:
    """The gate the package ships for this model (matched by weights fingerprint), and its file name."""
    folder = resources.files(BUNDLED[0]).joinpath(*BUNDLED[1:])
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".pt")) if folder.is_dir() else []
    for name in names:
        with resources.as_file(folder.joinpath(name)) as path:
            gate_file = load_gate(Path(path))
        if gate_file.fingerprint and gate_file.fingerprint == info.fingerprint:
            return gate_file, name
    shipped = ", ".join(name.removesuffix(".pt") for name in names) or "none"
    raise ValueError(
        f"{who}: the package ships no gate for this model (fingerprint {info.fingerprint or 'unknown'}; shipped: "
        f"{shipped}); train one with reasonkv calibrate --gates and pass -o gates=PATH"
    )


@register
@dataclass
class Seer(SelectionPolicy):
    """SeerAttention-R's gate (see :mod:`reasonkv.selection.gate`) over pooled pre-RoPE keys, kept as blocks fill.

    Each decode step, per kv-head group: the gate's softmax over the blocks before the current one; the
    top blocks within the budget are read, with the current block.

    Parameters
    ----------
    gates
        ``"bundled"`` (default: the gate the package ships for this model, matched by its weights), the
        path of a gate file, or a ``reasonkv calibrate --gates`` folder (its ``gates.pt``).
    threshold
        0 (default): the top blocks within the budget. Above 0 (the threshold variant): only the blocks
        whose gate probability exceeds it, at most the budget's.
    """

    name = "seer"
    summary = "selection (holds all tokens): a trained gate picks the blocks each step reads (SeerAttention-R)"
    paper = "Gao et al., SeerAttention-R: Sparse Attention Adaptation for Long Reasoning, 2025"

    gates: str = "bundled"
    threshold: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "threshold", 0.0)
        if self.threshold >= 1:
            raise ValueError(f"seer: threshold must be below 1 (a probability over blocks), got {self.threshold!r}")

    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        super().reset(info, batch, device)
        gate_file, where = self._gate_file(info)
        check_gate(gate_file, info, self.name, where)
        if gate_file.gate.shape.block_size != self.block_size:
            raise ValueError(
                f"seer: the gate{' ' + repr(where) if where else ''} was trained on blocks of "
                f"{gate_file.gate.shape.block_size} tokens; pass block_size={gate_file.gate.shape.block_size}, "
                f"not {self.block_size}"
            )
        self.gate = gate_file.gate.to(device)
        self.rotary = {layer: info.rotary_of(layer, self.name).tables(device) for layer in info.full_layers}

    def _gate_file(self, info: ModelInfo) -> tuple[GateFile, str]:
        if self.gates == "bundled":
            gate_file, name = bundled_gate(info, self.name)
            return gate_file, name
        path = self.gates
        if os.path.isdir(path):
            path = os.path.join(path, GATE_FILE)
        return load_gate(path), path

    def pool_input(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The gate pools pre-RoPE keys: the step's keys rotated back."""
        return self.rotary[layer].unrotate(keys, positions.clamp(min=0).unsqueeze(1))

    @torch.no_grad()
    def block_scores(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        probabilities = self.gate_probabilities(layer, query, pooled, position)
        keep = probabilities > self.threshold if self.threshold > 0 else None
        return probabilities, keep

    def gate_probabilities(
        self, layer: int, query: torch.Tensor, pooled: PooledKeys, position: torch.Tensor
    ) -> torch.Tensor:
        """The gate's softmax ``[batch, kv_heads, blocks]`` over the complete blocks before ``position``'s
        (0 elsewhere) for the post-RoPE ``query`` ``[batch, heads, head_dim]``."""
        before = self.rotary[layer].unrotate(query.unsqueeze(2), position.view(-1, 1, 1))
        gate = self.gate
        gate_query = gate.gate_queries(layer, before, position.view(-1, 1))
        gate_keys = gate.gate_keys(layer, pooled.maximum, pooled.minimum, pooled.mean)
        logits = gate.logits(gate_query, gate_keys)[:, :, 0]
        blocks = torch.arange(logits.shape[-1], device=logits.device)
        visible = blocks.view(1, 1, -1) < (position // self.block_size).view(-1, 1, 1)
        probabilities = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.nan_to_num(probabilities, nan=0.0)  # no block before the current one yet
