"""``reasonkv calibrate --centers``: the query centers TriAttention scores keys with, for any model.

:func:`run_centers` runs the model over what :class:`CentersSettings` names, rotates every full-attention layer's
post-RoPE queries back to pre-RoPE space and writes their per-(layer, head) complex mean and mean modulus
(:class:`~reasonkv.policies.query_centers.QueryCenters`), stamped with the model's shape and weights fingerprint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from reasonkv.calibrate.reading import ReadingSettings, read_sequences
from reasonkv.hf import AttentionTap, model_info
from reasonkv.policies.query_centers import CenterSums, QueryCenters

__all__ = ["CentersSettings", "compute_centers", "run_centers"]


@dataclass(frozen=True, kw_only=True)
class CentersSettings(ReadingSettings):
    """Everything one ``reasonkv calibrate --centers`` run is told: what :class:`ReadingSettings` holds (the
    model, what it reads, and ``out``, a new path or a query centers file this command wrote, which is replaced)."""

    FLAG: ClassVar[str] = "--centers"
    FILE_KIND: ClassVar[str] = "query centers file"

    def _load_existing(self, path: Path) -> None:
        QueryCenters.load(path)


@torch.inference_mode()
def compute_centers(model, sequences: list[list[int]], *, name: str = "", source: str = "") -> QueryCenters:
    """The query centers of ``model`` over ``sequences`` (token id lists), every token's query counted once."""
    info = model_info(model)
    layers = info.full_layers
    device = next(model.parameters()).device
    tables = {layer: info.rotary_of(layer, "calibrate --centers").tables(device) for layer in layers}
    sums = CenterSums(1, layers, info.num_heads, info.head_dim // 2, device)
    current: dict[str, torch.Tensor] = {}

    def listen(layer, query, key, mask, kwargs) -> None:
        if layer in tables:
            sums.add(layer, query, current["positions"], current["valid"], tables[layer])

    with AttentionTap(model, listen):
        for ids in sequences:
            current["positions"] = torch.arange(len(ids), device=device).unsqueeze(0)
            current["valid"] = torch.ones(1, len(ids), dtype=torch.bool, device=device)
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    mean, modulus = sums.means()
    return QueryCenters(
        mean=mean[0].cpu(),
        modulus=modulus[0].cpu(),
        layers=layers,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        head_dim=info.head_dim,
        model=name,
        fingerprint=info.fingerprint,
        tokens=int(sums.count[0, 0]),
        source=source,
    )


def run_centers(settings: CentersSettings) -> int:
    """Compute and write the query centers ``settings`` describe; returns 0."""
    model, tokenizer = settings.load()
    sequences = read_sequences(settings, tokenizer)
    centers = compute_centers(model, sequences, name=settings.model, source=settings.source)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    centers.save(settings.out)
    print(
        f"calibrate --centers: {centers.tokens} queries per head from {len(sequences)} sequences "
        f"({settings.source}); wrote {settings.out}",
        file=sys.stderr,
    )
    return 0
