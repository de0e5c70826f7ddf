"""A transformers model's rotary embedding per layer, as :class:`~reasonkv.policies.rotary.Rotary` data, and a
fingerprint of its weights.

The frequencies and scaling are read from the model's own rotary module, then checked end to end: the data
must reproduce the rotation the modeling file's ``apply_rotary_pos_emb`` gives a probe at a few positions
(which also tells the channel pairing). Types whose frequencies change with the length are refused by name,
as is anything the probe cannot reproduce.
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Any

import torch

from reasonkv.policies.rotary import PAIRINGS, Rotary

__all__ = ["STATIC_TYPES", "rotary_embeddings", "weights_fingerprint"]

# Rotary types whose frequencies and scaling are fixed once the model is built: rotated back exactly.
STATIC_TYPES = ("default", "linear", "llama3", "yarn")
_PROBE_POSITIONS = (0, 1, 5, 77, 500)
_SAMPLE = 16  # values hashed per parameter


def _rotary_module(model: torch.nn.Module, attention: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module that makes the cos/sin tables: the decoder's ``rotary_emb`` (or an attention module's)."""
    for owner in (getattr(model, "model", None), model):
        for holder in (owner, getattr(owner, "language_model", None)):
            module = getattr(holder, "rotary_emb", None)
            if isinstance(module, torch.nn.Module):
                return module
    module = getattr(attention, "rotary_emb", None)
    return module if isinstance(module, torch.nn.Module) else None


def _layer_rope(module: torch.nn.Module, layer_type: str | None) -> tuple[str, torch.Tensor | None, float]:
    """``(rope type, inv_freq, attention scaling)`` of one layer type (``None``: the module has one for all)."""
    kinds = getattr(module, "rope_type", "default")
    if isinstance(kinds, dict):
        kind = kinds.get(layer_type, "none")
        return (
            kind,
            getattr(module, f"{layer_type}_inv_freq", None),
            getattr(module, f"{layer_type}_attention_scaling", 1.0),
        )
    return str(kinds), getattr(module, "inv_freq", None), getattr(module, "attention_scaling", 1.0)


def _probe(
    module: torch.nn.Module, attention: torch.nn.Module, layer_type: str | None, candidate: Rotary
) -> Rotary | None:
    """``candidate`` with the pairing that reproduces the model's own rotation of a probe, or None."""
    apply = getattr(importlib.import_module(type(attention).__module__), "apply_rotary_pos_emb", None)
    if apply is None:
        return None
    positions = torch.tensor([_PROBE_POSITIONS])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, len(_PROBE_POSITIONS), candidate.head_dim, generator=generator)
    with torch.no_grad():
        cos, sin = module(x, positions) if layer_type is None else module(x, positions, layer_type)
        expected, _ = apply(x, x, cos.float().cpu(), sin.float().cpu())
    for pairing in PAIRINGS:
        rotary = Rotary(candidate.kind, candidate.inv_freq, candidate.scaling, pairing, candidate.head_dim)
        if torch.allclose(rotary.tables().rotate(x, positions), expected, rtol=1e-5, atol=1e-5):
            return rotary
    return None


def rotary_embeddings(
    model: torch.nn.Module, config: Any, attention: list[torch.nn.Module | None], head_dim: int
) -> tuple[Rotary | None, ...]:
    """Each decoder layer's rotation (``None`` for a layer without attention).

    ``config`` is the decoder's config, ``attention`` each layer's attention module. A rotation that
    cannot be undone is a :class:`Rotary` whose ``refused`` says why, naming its type.
    """
    layer_types = getattr(config, "layer_types", None)
    found: dict[str | None, Rotary] = {}
    out: list[Rotary | None] = []
    for index, module_of_layer in enumerate(attention):
        if module_of_layer is None:
            out.append(None)
            continue
        module = _rotary_module(model, module_of_layer)
        if module is None:
            out.append(Rotary("none", head_dim=head_dim, refused=f"{type(model).__name__} has no rotary embedding"))
            continue
        by_type = isinstance(getattr(module, "rope_type", None), dict)
        layer_type = layer_types[index] if by_type and layer_types else None
        if layer_type not in found:
            found[layer_type] = _rotation(model, module, module_of_layer, layer_type, head_dim)
        out.append(found[layer_type])
    return tuple(out)


def _rotation(model, module, attention, layer_type: str | None, head_dim: int) -> Rotary:
    kind, inv_freq, scaling = _layer_rope(module, layer_type)
    if kind not in STATIC_TYPES:
        reason = f"rotary type {kind!r} is not one whose rotation can be undone from a position alone"
        return Rotary(kind, head_dim=head_dim, refused=f"{reason} (it can for: {', '.join(STATIC_TYPES)})")
    if not isinstance(inv_freq, torch.Tensor) or 2 * inv_freq.numel() > head_dim:
        return Rotary(kind, head_dim=head_dim, refused=f"cannot read the frequencies of {type(module).__name__}")
    if inv_freq.is_meta:
        return Rotary(kind, head_dim=head_dim, refused="the model is on the meta device: its tables hold no values")
    candidate = Rotary(kind, tuple(inv_freq.float().cpu().tolist()), float(scaling), "half", head_dim)
    rotary = _probe(module, attention, layer_type, candidate)
    if rotary is None:
        reason = f"reasonkv cannot reproduce how {type(model).__name__} applies its rotary tables"
        return Rotary(kind, head_dim=head_dim, refused=reason)
    return rotary


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A SHA-256 of every parameter's name, shape and a sample of its values rounded to bf16: the same
    weights give the same fingerprint in every dtype, another checkpoint another one (empty for a model on the
    meta device, whose weights hold no values). One device read."""
    if any(parameter.is_meta for parameter in model.parameters()):
        return ""
    digest = hashlib.sha256(type(model).__name__.encode())
    samples = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            flat = parameter.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLE)
            samples.append(flat[::step][:_SAMPLE].to(torch.bfloat16).float())
    if samples:
        digest.update(str(torch.cat(samples).cpu().view(torch.int32).tolist()).encode())
    return digest.hexdigest()[:32]
