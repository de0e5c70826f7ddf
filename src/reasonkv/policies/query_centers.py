"""Query centers: per (layer, query head) statistics of the pre-RoPE queries in the frequency domain, what
TriAttention scores keys with. Torch only.

For every channel pair ``f`` (see :mod:`reasonkv.policies.rotary`) of every query head: the complex mean
``q̄_f`` of the pre-RoPE queries and their mean modulus ``E|q_f|``. :class:`CenterSums` accumulates them
(per batch row) from post-RoPE queries; :class:`QueryCenters` is the file ``reasonkv calibrate --centers``
writes, checked against the model it is used with (shape and weights fingerprint).

The file is a ``torch.save`` of plain tensors, numbers and strings (read with ``weights_only=True``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from reasonkv.policies.common import bundled_file
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.rotary import RotaryTables
from reasonkv.selection.torchfile import read_torch_file

__all__ = ["FORMAT", "CenterSums", "QueryCenters", "bundled_centers"]

FORMAT = "reasonkv-query-centers"
VERSION = 1
BUNDLED = ("reasonkv", "data", "centers")  # package folder of the bundled models' files
# What the file holds after the tensors and the layers, with its type.
_FIELDS = dict(num_layers=int, num_heads=int, head_dim=int, model=str, fingerprint=str, tokens=int, source=str)


class CenterSums:
    """Running sums of pre-RoPE query pairs per batch row, layer and query head.

    ``layers`` are the decoder layers summed (their order is the layer axis of the sums).
    """

    def __init__(self, batch: int, layers: tuple[int, ...], heads: int, pairs: int, device=None):
        self.layers = layers
        self.column = {layer: i for i, layer in enumerate(layers)}
        shape = (batch, len(layers), heads, pairs)
        self.sum = torch.zeros(shape, dtype=torch.complex64, device=device)
        self.modulus = torch.zeros(shape, dtype=torch.float32, device=device)
        self.count = torch.zeros((batch, len(layers)), dtype=torch.float32, device=device)

    def add(
        self, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, tables: RotaryTables
    ) -> None:
        """Add post-RoPE ``queries [batch, heads, q, head_dim]`` at ``positions [batch, q]``; padding (``valid``
        False) is left out."""
        pairs = tables.pairs(queries) * tables.phases(positions, inverse=True).unsqueeze(1)
        weight = valid.to(torch.float32).view(valid.shape[0], 1, -1, 1)
        column = self.column[layer]
        self.sum[:, column] += (pairs * weight).sum(dim=2)
        self.modulus[:, column] += (pairs.abs() * weight).sum(dim=2)
        self.count[:, column] += valid.sum(dim=1)

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q̄ complex64, E|q| float32)``, each ``[batch, layers, heads, pairs]`` (zero where nothing was added)."""
        count = self.count.clamp(min=1.0).view(*self.count.shape, 1, 1)
        return self.sum / count, self.modulus / count


@dataclass(frozen=True)
class QueryCenters:
    """Query centers of one model: ``q̄`` (``mean``, complex64) and ``E|q|`` (``modulus``, float32), each
    ``[len(layers), num_heads, head_dim / 2]``, for the model's full-attention ``layers``."""

    mean: torch.Tensor
    modulus: torch.Tensor
    layers: tuple[int, ...]
    num_layers: int
    num_heads: int
    head_dim: int
    model: str = ""  # the model's name as given at calibration
    fingerprint: str = ""  # its weights fingerprint (ModelInfo.fingerprint)
    tokens: int = 0  # queries averaged per (layer, head)
    source: str = ""  # what they were computed on (a dataset and trace count, or a text file)

    def save(self, path: str | os.PathLike[str]) -> None:
        torch.save(
            {
                "format": FORMAT,
                "version": VERSION,
                "mean_real": self.mean.real.contiguous().cpu(),
                "mean_imag": self.mean.imag.contiguous().cpu(),
                "modulus": self.modulus.contiguous().cpu(),
                "layers": list(self.layers),
                **{name: getattr(self, name) for name in _FIELDS},
            },
            os.fspath(path),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> QueryCenters:
        """Read a file :meth:`save` wrote; ``ValueError`` naming the path for anything else."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"query centers file {path!r} does not exist (make one: reasonkv calibrate --centers)")
        payload = read_torch_file(path, FORMAT, "query centers file", "reasonkv calibrate --centers")
        if payload.get("version") != VERSION:
            raise ValueError(f"{path!r} has version {payload.get('version')!r}; this reasonkv reads version {VERSION}")
        return cls(
            mean=torch.complex(payload["mean_real"].float(), payload["mean_imag"].float()),
            modulus=payload["modulus"].float(),
            layers=tuple(int(layer) for layer in payload["layers"]),
            **{name: kind(payload[name]) for name, kind in _FIELDS.items()},
        )

    def check(self, info: ModelInfo, who: str, path: str = "") -> None:
        """``ValueError`` naming ``who`` when these centers were made for another model (shape or weights)."""
        where = f" in {path!r}" if path else ""
        mine = (self.num_layers, self.num_heads, self.head_dim)
        theirs = (info.num_layers, info.num_heads, info.head_dim)
        if mine != theirs:
            raise ValueError(
                f"{who}: the query centers{where} are for a model with {mine[0]} layers, {mine[1]} heads of dim "
                f"{mine[2]} ({self.model or 'unnamed'}); this model has {theirs[0]} layers, {theirs[1]} heads of "
                f"dim {theirs[2]}"
            )
        if not set(info.full_layers) <= set(self.layers):
            missing = sorted(set(info.full_layers) - set(self.layers))
            raise ValueError(f"{who}: the query centers{where} lack layers {missing}")
        if self.fingerprint and info.fingerprint and self.fingerprint != info.fingerprint:
            raise ValueError(
                f"{who}: the query centers{where} were computed on other weights ({self.model or 'unnamed'}, "
                f"fingerprint {self.fingerprint}) than this model's (fingerprint {info.fingerprint}); "
                "make this model's with reasonkv calibrate --centers"
            )

    def at(self, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q̄, E|q|)`` of ``layers``, each ``[len(layers), heads, pairs]``."""
        index = [self.layers.index(layer) for layer in layers]
        return self.mean[index], self.modulus[index]


def bundled_centers(info: ModelInfo, who: str) -> tuple[QueryCenters, str]:
    """The query centers the package ships for this model (matched by fingerprint), and their file name."""
    remedy = "make them with reasonkv calibrate --centers and pass -o stats=PATH"
    return bundled_file(BUNDLED, QueryCenters.load, info, who, "query centers", remedy)
