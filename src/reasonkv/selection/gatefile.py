"""The gate file: a trained :class:`~reasonkv.selection.gate.SeerGate` and what it was trained for.

A ``.pt`` file of plain tensors and numbers (read with ``weights_only=True``): the gate's shape (layers,
query and kv heads, head_dim, gate_dim, block_size, RoPE base, whether q and k are RMS-normalised), the
model's name and weights fingerprint, what it was trained on, and each layer's query and key projections
and RMSNorm weights. Version 1 files (gates without RMSNorm) load as gates with ``qk_norm`` off. Loading checks the
format; :func:`check_gate` checks it against the model it is used with: a gate for another shape is
refused with the counts that differ, one from other weights by the fingerprint.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reasonkv.selection.gate import GateShape, SeerGate
from reasonkv.selection.torchfile import read_torch_file

__all__ = ["FORMAT", "GateFile", "check_gate", "gate_bytes", "load_gate", "save_gate"]

FORMAT, VERSION = "reasonkv-seer-gate", 2
READS = (1, 2)  # version 1: no RMSNorm on the gate's q and k


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
        "query": [w.detach().to(torch.float16).cpu().contiguous() for w in gate.query],
        "key": [w.detach().to(torch.float16).cpu().contiguous() for w in gate.key],
        "query_norm": [w.detach().to(torch.float16).cpu().contiguous() for w in gate.query_norm],
        "key_norm": [w.detach().to(torch.float16).cpu().contiguous() for w in gate.key_norm],
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
    norms = shape.layers if shape.qk_norm else 0
    lists = {"query": shape.layers, "key": shape.layers, "query_norm": norms, "key_norm": norms}
    for name, layers in lists.items():
        if len(payload.get(name, [])) != layers:
            raise ValueError(f"{path!r}: {len(payload.get(name, []))} layers of {name} weights where {layers} belong")
    with torch.no_grad():
        mine_all = [parameter for name in lists for parameter in getattr(gate, name)]
        theirs_all = [weight for name in lists for weight in payload.get(name, [])]
        for mine, theirs in zip(mine_all, theirs_all, strict=True):
            if mine.shape != theirs.shape:
                raise ValueError(f"{path!r}: a weight of shape {list(theirs.shape)} where {list(mine.shape)} belongs")
            mine.copy_(theirs.float())
    return GateFile(
        gate, str(payload["model"]), str(payload["fingerprint"]), str(payload["source"]), payload["training"]
    )


def check_gate(gate_file: GateFile, info, who: str, path: str = "") -> None:
    """``ValueError`` naming ``who`` when the gate was made for another model: its layer, head or head_dim
    counts differ from ``info`` (a :class:`~reasonkv.policies.contract.ModelInfo`), or its weights do."""
    where = f" {path!r}" if path else ""
    shape = gate_file.gate.shape
    mine = {"layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
    theirs = {
        "layers": info.num_layers,
        "heads": info.num_heads,
        "kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
    }
    differ = [f"{name} {mine[name]} (the model has {theirs[name]})" for name in mine if mine[name] != theirs[name]]
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
