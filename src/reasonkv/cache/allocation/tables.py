"""How many tokens each (layer, kv-head) keeps: the static allocations' budget tables (torch only).

Every table is ``[layers, kv_heads]`` (the evicting layers, in order) summing to exactly ``K x layers x
kv_heads``, the uniform cache's total, so allocations compare at equal tokens held. ``pyramid`` is
PyramidKV's schedule as KVCache-Factory computes it (capped for a short sequence), ``calibrated`` comes from
a budget file (integer ``budgets``, or ``weights`` shared out in proportion after every head's protected
tokens), both rounded by the largest remainders; ``adaptive`` starts from the uniform table. The rules and
their differences from the reference code are in docs/budgets.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from reasonkv.suggest.integers import check_int, is_int

__all__ = [
    "PYRAMID_BETA",
    "BudgetFile",
    "apportion",
    "load_budget_file",
    "pyramid_table",
]

PYRAMID_BETA = 20  # PyramidKV: the last layer keeps K // beta


def apportion(weights: torch.Tensor, total: int, floor: int) -> torch.Tensor:
    """Integers, one per weight, each at least ``floor``, summing to exactly ``total``: every entry gets
    ``floor``, the rest is shared in proportion to ``weights`` (non-negative; all zero: equally), rounded
    down, and what rounding left goes one each to the largest remainders (ties: the earlier entry)."""
    flat = weights.double().flatten()
    n = flat.numel()
    if total < n * floor:
        raise ValueError(f"a total of {total} tokens cannot give {n} heads {floor} each")
    if bool((flat < 0).any()) or not bool(torch.isfinite(flat).all()):
        raise ValueError("weights must be finite and non-negative")
    rest = total - n * floor
    share = flat / flat.sum() if float(flat.sum()) > 0 else torch.full_like(flat, 1.0 / n)
    exact = share * rest
    base = exact.floor().long()
    left = rest - int(base.sum())
    remainder = exact - base.double()
    # Largest remainders first; a stable sort keeps the earlier entry first among equals.
    order = torch.sort(-remainder, stable=True).indices[:left]
    base[order] += 1
    return (base + floor).view(weights.shape)


def pyramid_table(
    budget: int, layers: int, kv_heads: int, protected: int, length: int | None = None, held: int | None = None
) -> torch.Tensor:
    """PyramidKV's linear schedule, ``[layers, kv_heads]``, summing to ``budget x layers x kv_heads``, for a
    sequence of ``length`` tokens seen whose fullest head holds ``held`` (None: no cap)."""
    span = budget - protected  # what the schedule shares; every layer keeps the protected tokens on top
    short = length is not None and length < 2 * span
    if layers == 1 or span <= 0 or short:
        return torch.full((layers, kv_heads), budget, dtype=torch.long)
    bottom = max(span // PYRAMID_BETA, 0 if protected else 1)
    top = 2 * span - bottom
    limits = [n - protected for n in (length, held) if n is not None]
    if limits and top >= min(limits):  # the first layer keeps no more than the sequence, nor than it holds
        top = max(min(limits), span)
        bottom = 2 * span - top
    depth = torch.arange(layers, dtype=torch.float64)
    per_layer = top - (top - bottom) * depth / (layers - 1)  # mean exactly `span`
    # Above the bottom, the layers share (span - bottom) x layers in proportion to the schedule.
    counts = apportion(per_layer - bottom, (span - bottom) * layers, 0) + bottom + protected
    return counts.view(layers, 1).expand(layers, kv_heads).clone()


class BudgetFile:
    """A calibrated budget file, read and checked (without a model): ``layers`` x ``kv_heads`` integer
    ``budgets`` or non-negative ``weights``; :meth:`table` checks its shape against a model.

    The file is JSON: ``{"layers": L, "kv_heads": H, "budgets": [[...] x H] x L}`` or the same with
    ``"weights"`` (and anything else, e.g. the model and how the weights were measured, as notes).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            data = json.loads(self.path.read_text())
        except OSError as error:
            raise ValueError(f"cannot read the budget file {str(self.path)!r}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"the budget file {str(self.path)!r} is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the budget file {str(self.path)!r} must hold a JSON object")
        kinds = [key for key in ("budgets", "weights") if key in data]
        if len(kinds) != 1:
            raise ValueError(f"the budget file {str(self.path)!r} must hold exactly one of 'budgets' or 'weights'")
        self.kind = kinds[0]
        self.layers, self.kv_heads = (self._count(data, key) for key in ("layers", "kv_heads"))
        rows = data[self.kind]
        if not isinstance(rows, list) or len(rows) != self.layers:
            got = len(rows) if isinstance(rows, list) else type(rows).__name__
            raise ValueError(f"{self._where()}: '{self.kind}' must list {self.layers} layers, got {got}")
        for index, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != self.kv_heads:
                got = len(row) if isinstance(row, list) else type(row).__name__
                raise ValueError(f"{self._where()}: layer {index} must list {self.kv_heads} kv-heads, got {got}")
            for head, value in enumerate(row):
                self._check_value(value, index, head)
        dtype = torch.long if self.kind == "budgets" else torch.float64
        self.values = torch.tensor(rows, dtype=dtype).view(self.layers, self.kv_heads)

    def _where(self) -> str:
        return f"budget file {str(self.path)!r}"

    def _count(self, data: dict, key: str) -> int:
        value = data.get(key)
        check_int(f"{self._where()}: {key!r}", value, 1)
        return value

    def _check_value(self, value: object, layer: int, head: int) -> None:
        integer = is_int(value)
        number = integer or (isinstance(value, float) and math.isfinite(value))
        if self.kind == "budgets" and not integer:
            raise ValueError(f"{self._where()}: budgets[{layer}][{head}] must be an integer, got {value!r}")
        if not number:
            raise ValueError(f"{self._where()}: weights[{layer}][{head}] must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"{self._where()}: {self.kind}[{layer}][{head}] is negative ({value})")

    def check_total(self, budget: int, protected: int) -> None:
        """Integer budgets must sum to ``budget x layers x kv_heads`` and give every head its protected
        tokens; weights must leave room for the protected tokens of every head."""
        total = budget * self.layers * self.kv_heads
        if self.kind == "budgets":
            got = int(self.values.sum())
            if got != total:
                raise ValueError(
                    f"{self._where()}: the budgets sum to {got}, but K x layers x kv-heads = {budget} x {self.layers} "
                    f"x {self.kv_heads} = {total}"
                )
            low = int(self.values.min())
            if low < protected:
                raise ValueError(
                    f"{self._where()}: a head's budget of {low} is below the policy's {protected} protected tokens "
                    "(sinks + window)"
                )
        elif budget < protected:
            raise ValueError(f"budget {budget} is below the policy's {protected} protected tokens")

    def table(self, budget: int, layers: int, kv_heads: int, protected: int) -> torch.Tensor:
        """The ``[layers, kv_heads]`` budgets for a model with this many evicting layers and kv-heads."""
        if (layers, kv_heads) != (self.layers, self.kv_heads):
            raise ValueError(
                f"{self._where()} is for {self.layers} layers x {self.kv_heads} kv-heads, but the model has "
                f"{layers} full-attention layers x {kv_heads} kv-heads"
            )
        self.check_total(budget, protected)
        if self.kind == "budgets":
            return self.values.clone()
        return apportion(self.values, budget * layers * kv_heads, protected)


def load_budget_file(path: str | Path) -> BudgetFile:
    """Read and check a budget file (see :class:`BudgetFile`)."""
    return BudgetFile(path)
