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
from reasonkv.policies.options import check_at_least, check_choice
from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.blocks import RULES
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

    Each decode step, per kv-head group: the gate's softmax over every block up to the current one (the
    current block, while it fills, has a zeroed gate key: logit 0, as the authors'); by default the top
    ``K // block_size`` blocks are read, and the current block if it was not among them.

    Parameters
    ----------
    block_size
        Tokens per block (default 64, the authors').
    gates
        ``"bundled"`` (default: the gate the package ships for this model, matched by its weights), the
        path of a gate file, or a ``reasonkv calibrate --gates`` folder (its ``gates.pt``).
    rule
        How the budget counts blocks: ``plus`` (default, the authors': the top ``K // block_size`` of all
        blocks, the current one competing, then the current block if it was not chosen, so a step reads
        ``K`` tokens or one block more) or ``within`` (the current block and the top ``K // block_size - 1``
        before it: a step never reads more than ``K`` tokens per head, the bytes an eviction cache of ``K``
        holds, for comparisons at equal bytes).
    threshold
        0 (default): the top blocks by ``rule``; above 0 (the threshold variant), the blocks whose gate
        probability exceeds it and the current block, however many pass as the authors' (the budget is not
        used), unless ``cap``.
    cap
        With ``threshold``: read at most the budget's blocks by ``rule`` of those that pass (default False:
        the authors do not cap; capping bounds what a step reads).
    """

    name = "seer"
    summary = "selection (holds all tokens): a trained gate picks the blocks each step reads (SeerAttention-R)"
    paper = "Gao et al., SeerAttention-R: Sparse Attention Adaptation for Long Reasoning, 2025"

    block_size: int = 64
    gates: str = "bundled"
    rule: str = "plus"
    threshold: float = 0.0
    cap: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "threshold", 0.0)
        if self.threshold >= 1:
            raise ValueError(f"seer: threshold must be below 1 (a probability over blocks), got {self.threshold!r}")
        check_choice(self, "rule", RULES)
        if self.cap and not self.threshold:
            raise ValueError("seer: cap=True caps the threshold variant; it needs threshold above 0")

    @property
    def block_rule(self) -> str:
        return self.rule

    @property
    def capped(self) -> bool:
        return self.cap or not self.threshold

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
        """The gate's softmax ``[batch, kv_heads, blocks]`` over the blocks up to ``position``'s (0 after it) for
        the post-RoPE ``query`` ``[batch, heads, head_dim]``. The current block's logit is 0 while it fills (the
        authors zero its gate key until it is complete), its own once its last token is in."""
        before = self.rotary[layer].unrotate(query.unsqueeze(2), position.view(-1, 1, 1))
        gate = self.gate
        gate_query = gate.gate_queries(layer, before, position.view(-1, 1))
        gate_keys = gate.gate_keys(layer, pooled.maximum, pooled.minimum, pooled.mean)
        logits = gate.logits(gate_query, gate_keys)[:, :, 0]
        blocks = torch.arange(logits.shape[-1], device=logits.device).view(1, 1, -1)
        current = (position // self.block_size).view(-1, 1, 1)
        filling = ((position + 1) % self.block_size != 0).view(-1, 1, 1)
        logits = logits.masked_fill((blocks == current) & filling, 0.0)
        return logits.masked_fill(blocks > current, float("-inf")).softmax(dim=-1)
