"""SeerAttention-R (Gao et al., "SeerAttention-R: Sparse Attention Adaptation for Long Reasoning", 2025): a
small trained gate chooses, per kv-head group and decode step, the blocks of the K/V cache to read. A
selection policy: the cache holds every token. This module holds the gate (:class:`SeerGate`, the authors'
``attn_gate_inf.py``), its file (:func:`save_gate`, :func:`load_gate`, :func:`check_gate`), its training by
self-distillation (:func:`layer_example`, :func:`gate_loss`, :func:`train_gate`; the model is run by
:mod:`reasonkv.calibrate.gates`) and the policy. The gate, its deviations from the authors' and its training
are described in ``docs/selection.md``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from reasonkv.policies.common import bundled_file
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.options import check_at_least, check_choice
from reasonkv.policies.registry import register
from reasonkv.policies.selective import SelectionPolicy
from reasonkv.selection.blocks import RULES
from reasonkv.selection.pooled import PooledKeys
from reasonkv.selection.torchfile import read_torch_file
from reasonkv.suggest.integers import check_int

__all__ = [
    "FORMAT",
    "GATE_DIM",
    "GATE_FILE",
    "INITS",
    "GateFile",
    "GateShape",
    "LayerExample",
    "Seer",
    "SeerGate",
    "block_pool",
    "block_targets",
    "bundled_gate",
    "check_gate",
    "gate_bytes",
    "gate_loss",
    "gate_rope",
    "layer_example",
    "load_gate",
    "mean_loss",
    "rms_norm",
    "save_gate",
    "train_gate",
]

GATE_DIM = 128  # the authors' gate width
INITS = ("normal", "xavier")
NORM_EPS = 1e-6

FORMAT, VERSION = "reasonkv-seer-gate", 2
READS = (1, 2)  # version 1: no RMSNorm on the gate's q and k
WEIGHTS = ("query", "key", "query_norm", "key_norm")  # the gate's weight lists, in the file's order
BUNDLED = ("reasonkv", "data", "gates")  # package folder of the bundled models' gate files
GATE_FILE = "gates.pt"  # the name reasonkv calibrate --gates writes in its folder


# ---------------------------------------------------------------------------------------------------- the gate
class GateShape:
    """What a gate was built for: layers, query and kv heads, head_dim, gate_dim, block_size, RoPE base, and
    whether the gate's q and k are RMS-normalised (``qk_norm``)."""

    FIELDS = ("layers", "heads", "kv_heads", "head_dim", "gate_dim", "block_size", "rope_base", "qk_norm")

    def __init__(
        self, layers, heads, kv_heads, head_dim, gate_dim=GATE_DIM, block_size=64, rope_base=10000.0, qk_norm=True
    ):
        self.layers, self.heads, self.kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.gate_dim, self.block_size, self.rope_base = gate_dim, block_size, float(rope_base)
        if not isinstance(qk_norm, bool):
            raise ValueError(f"gate qk_norm must be True or False, got {qk_norm!r}")
        self.qk_norm = qk_norm
        for name in ("layers", "heads", "kv_heads", "head_dim", "gate_dim", "block_size"):
            check_int(f"gate {name}", getattr(self, name), 1)
        if heads % kv_heads:
            raise ValueError(f"gate heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if gate_dim % 2:
            raise ValueError(f"gate_dim must be even (RoPE rotates channel pairs), got {gate_dim}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}


def gate_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (half pairing, as transformers' ``rotate_half``) of ``x`` ``[..., n, dim]`` at ``positions``
    (broadcast to ``[..., n]``), in float32."""
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : dim // 2].float(), x[..., dim // 2 :].float()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (the authors' RMSNorm, eps 1e-6)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


class SeerGate(nn.Module):
    """The gates of every layer: ``query[layer]`` ``[kv_heads, group, head_dim, gate_dim]``,
    ``key[layer]`` ``[kv_heads, 3 * head_dim, gate_dim]`` and, with ``qk_norm``, the RMSNorm weights
    ``query_norm[layer]``/``key_norm[layer]`` ``[gate_dim]`` (ones at first). ``init``: ``normal`` (default:
    N(0, 0.02), the authors' training initialisation) or ``xavier`` (Xavier-uniform)."""

    def __init__(self, shape: GateShape, seed: int = 0, init: str = "normal"):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"gate init must be one of {', '.join(INITS)}, got {init!r}")
        self.shape = s = shape
        generator = torch.Generator().manual_seed(seed)
        draw = _normal if init == "normal" else _xavier
        self.query = nn.ParameterList(
            [nn.Parameter(draw((s.kv_heads, s.group, s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )
        self.key = nn.ParameterList(
            [nn.Parameter(draw((s.kv_heads, 3 * s.head_dim, s.gate_dim), generator)) for _ in range(s.layers)]
        )
        norms = s.layers if s.qk_norm else 0
        self.query_norm = nn.ParameterList([nn.Parameter(torch.ones(s.gate_dim)) for _ in range(norms)])
        self.key_norm = nn.ParameterList([nn.Parameter(torch.ones(s.gate_dim)) for _ in range(norms)])

    def gate_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``queries`` ``[batch, heads, n, head_dim]`` at ``positions`` ``[batch, n]`` ->
        ``[batch, kv_heads, n, gate_dim]``, rotated."""
        batch, heads, n, dim = queries.shape
        grouped = queries.float().view(batch, self.shape.kv_heads, self.shape.group, n, dim)
        projected = torch.einsum("bkgnd,kgdo->bkno", grouped, self.query[layer])
        if self.shape.qk_norm:
            projected = rms_norm(projected, self.query_norm[layer])
        return gate_rope(projected, positions.unsqueeze(1), self.shape.rope_base)

    def gate_keys(self, layer: int, maximum: torch.Tensor, minimum: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Pooled pre-RoPE keys ``[batch, kv_heads, blocks, head_dim]`` (max, min, mean) -> gate keys
        ``[batch, kv_heads, blocks, gate_dim]`` rotated at each block's first position."""
        pooled = torch.cat([maximum, minimum, mean], dim=-1).float()
        pooled = torch.where(torch.isfinite(pooled), pooled, 0.0)  # blocks with no token yet
        projected = torch.einsum("bknc,kco->bkno", pooled, self.key[layer])
        if self.shape.qk_norm:
            projected = rms_norm(projected, self.key_norm[layer])
        starts = torch.arange(pooled.shape[2], device=pooled.device) * self.shape.block_size
        return gate_rope(projected, starts, self.shape.rope_base)

    def logits(self, gate_queries: torch.Tensor, gate_keys: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, n, blocks]``: ``q · K / sqrt(gate_dim)`` (before the softmax over blocks)."""
        return gate_queries @ gate_keys.transpose(-1, -2) / math.sqrt(self.shape.gate_dim)


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * 0.02


def _xavier(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    fan_in, fan_out = shape[-2], shape[-1]
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


# ---------------------------------------------------------------------------------------------------- its file
@dataclass
class GateFile:
    """A gate and its provenance."""

    gate: SeerGate
    model: str = ""
    fingerprint: str = ""
    source: str = ""
    training: dict = field(default_factory=dict)  # steps, final loss, ...


def save_gate(gate_file: GateFile, path: str | os.PathLike[str]) -> Path:
    """Write ``gate_file`` to ``path`` (weights as float16: a gate is a selector, not the model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gate_bytes(gate_file))
    return path


def gate_bytes(gate_file: GateFile) -> bytes:
    """The file :func:`save_gate` writes, as bytes (for a writer that replaces files whole)."""
    gate = gate_file.gate
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "shape": gate.shape.as_dict(),
        "model": gate_file.model,
        "fingerprint": gate_file.fingerprint,
        "source": gate_file.source,
        "training": dict(gate_file.training),
        **{name: [w.detach().to(torch.float16).cpu().contiguous() for w in getattr(gate, name)] for name in WEIGHTS},
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def load_gate(path: str | os.PathLike[str]) -> GateFile:
    """Read a file :func:`save_gate` wrote; ``ValueError`` naming the path for anything else."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"gate file {path!r} does not exist (train one: reasonkv calibrate --gates)")
    payload = read_torch_file(path, FORMAT, "gate file", "reasonkv calibrate --gates (gates.pt)")
    version = payload.get("version")
    if version not in READS:
        raise ValueError(
            f"{path!r} has gate file version {version!r}; this reasonkv reads {', '.join(map(str, READS))}"
        )
    shape = GateShape(**{"qk_norm": False, **payload["shape"]})
    gate = SeerGate(shape)
    for name in WEIGHTS:
        mine, theirs = getattr(gate, name), payload.get(name, [])
        if len(theirs) != len(mine):
            raise ValueError(f"{path!r}: {len(theirs)} layers of {name} weights where {len(mine)} belong")
    with torch.no_grad():
        for name in WEIGHTS:
            for mine, theirs in zip(getattr(gate, name), payload.get(name, []), strict=True):
                if mine.shape != theirs.shape:
                    raise ValueError(
                        f"{path!r}: a weight of shape {list(theirs.shape)} where {list(mine.shape)} belongs"
                    )
                mine.copy_(theirs.float())
    return GateFile(
        gate, str(payload["model"]), str(payload["fingerprint"]), str(payload["source"]), payload["training"]
    )


def check_gate(gate_file: GateFile, info: ModelInfo, who: str, path: str = "") -> None:
    """``ValueError`` naming ``who`` when the gate was made for another model: its layer, head or head_dim
    counts differ from ``info``'s, or its weights do."""
    where = f" {path!r}" if path else ""
    shape = gate_file.gate.shape
    mine = (shape.layers, shape.heads, shape.kv_heads, shape.head_dim)
    theirs = (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim)
    differ = [
        f"{name} {a} (the model has {b})"
        for name, a, b in zip(("layers", "heads", "kv_heads", "head_dim"), mine, theirs, strict=True)
        if a != b
    ]
    if differ:
        raise ValueError(
            f"{who}: the gate file{where} is for another model ({gate_file.model or 'unnamed'}): " + ", ".join(differ)
        )
    if gate_file.fingerprint and info.fingerprint and gate_file.fingerprint != info.fingerprint:
        raise ValueError(
            f"{who}: the gate file{where} was trained on other weights ({gate_file.model or 'unnamed'}, fingerprint "
            f"{gate_file.fingerprint}) than this model's (fingerprint {info.fingerprint}); train this model's with "
            "reasonkv calibrate --gates"
        )


def bundled_gate(info: ModelInfo, who: str) -> tuple[GateFile, str]:
    """The gate the package ships for this model (matched by weights fingerprint), and its file name."""
    remedy = "train one with reasonkv calibrate --gates and pass -o gates=PATH"
    return bundled_file(BUNDLED, load_gate, info, who, "gate", remedy)


# ---------------------------------------------------------------------------------------------------- its training
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

    def logits(self, gate: SeerGate) -> torch.Tensor:
        """The gate's logits ``[kv_heads, n, blocks]`` of this example's queries over its blocks."""
        gate_queries = gate.gate_queries(self.layer, self.queries.unsqueeze(0), self.positions.unsqueeze(0))
        pooled = (self.maximum.unsqueeze(0), self.minimum.unsqueeze(0), self.mean.unsqueeze(0))
        return gate.logits(gate_queries, gate.gate_keys(self.layer, *pooled))[0]


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
    log_p = example.logits(gate).masked_fill(~example.visible, float("-inf")).log_softmax(dim=-1)
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


# ---------------------------------------------------------------------------------------------------- the policy
@register
@dataclass
class Seer(SelectionPolicy):
    """SeerAttention-R's gate (:class:`SeerGate`) over pooled pre-RoPE keys, kept as blocks fill.

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
            return bundled_gate(info, self.name)
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
