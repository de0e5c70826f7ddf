"""The allocations, one class each: how ``K x layers x kv_heads`` is shared among the (layer, kv-head) pairs.

An allocation owns its rules: the settings that apply to it (:data:`ALLOCATION_SETTINGS`), its table, whether
it re-plans at each eviction or by a row's length, the slots each head keeps, and how records name it. A new
allocation is one class here, registered in :data:`RULES`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from reasonkv.cache.allocation.choose import adaptive_counts, adaptive_floor, static_counts
from reasonkv.cache.allocation.tables import load_budget_file, pyramid_table
from reasonkv.suggest.integers import is_number

__all__ = [
    "ALLOCATIONS",
    "ALLOCATION_SETTINGS",
    "DEFAULT_ADAPTIVE_ALPHA",
    "RULES",
    "Adaptive",
    "Allocation",
    "Calibrated",
    "Pyramid",
    "Uniform",
    "allocation_class",
    "allocation_rule",
    "budget_table",
    "check_allocation",
    "check_allocation_settings",
]

DEFAULT_ADAPTIVE_ALPHA = 0.2  # AdaKV's default

# The settings that apply under some allocations only, and their command-line flags.
_FLAGS = {"budgets_file": "--budgets-file", "adaptive_alpha": "--adaptive-alpha", "ragged": "--padded-heads"}


class Allocation:
    """One way of sharing the budget: its table, and the slots each head keeps at an eviction."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what ``--allocation``'s help says of it
    settings: ClassVar[tuple[str, ...]] = ()  # the settings of ALLOCATION_SETTINGS that apply to it
    per_head: ClassVar[bool] = True  # heads may keep different numbers of tokens
    per_length: ClassVar[bool] = False  # its table depends on the tokens a row has seen and holds (pyramid)

    def check(self, budget: int, protected: int) -> None:
        """``ValueError`` when it cannot share ``budget`` with ``protected`` tokens in every head (without a model)."""

    def table(
        self,
        budget: int,
        layers: int,
        kv_heads: int,
        protected: int,
        length: int | None = None,
        held: int | None = None,
    ) -> torch.Tensor:
        """``[layers, kv_heads]`` tokens each head keeps, summing to ``budget x layers x kv_heads``, each at least
        ``protected``; ``length``, ``held``: the tokens a row has seen and the most one of its heads holds."""
        return torch.full((layers, kv_heads), budget, dtype=torch.long)

    def counts(self, rankings: list[torch.Tensor], tables: torch.Tensor, budget: int) -> list[torch.Tensor]:
        """``[rows, kv_heads]`` slots each head keeps, per evicting layer, from the policy's ``rankings`` and the
        budget ``tables`` (``[layers, kv_heads]``, or ``[layers, rows, kv_heads]``: one per row)."""
        return [static_counts(r, t) for r, t in zip(rankings, tables, strict=True)]

    def extent(self, table: torch.Tensor, budget: int) -> tuple[int, int]:
        """The fewest tokens a head keeps after an eviction (a row is first due ``B`` above it) and the most."""
        return int(table.min()), int(table.max())

    def options(self) -> dict[str, Any]:
        """Its own settings (besides ``ragged``) as JSON values, as a spec stores them."""
        return {}

    def trace_settings(self, budget: int) -> dict[str, Any]:
        """What a decision trace's settings add of it (besides its name, table and ``ragged_heads``)."""
        return self.options()

    @property
    def tag(self) -> str:
        """The suffix that names it after a policy's label (``h2o~pyramid``)."""
        return f"~{self.name}"

    def record(self) -> dict[str, Any]:
        """What a record keeps of it: ``{"allocation": name}``."""
        return {"allocation": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"


class Uniform(Allocation):
    """``K`` every head: the cache without an allocation (records and labels say nothing of it)."""

    name = "uniform"
    summary = "K each, default"
    per_head = False

    @property
    def tag(self) -> str:
        return ""

    def record(self) -> dict[str, Any]:
        return {}


class Pyramid(Allocation):
    """PyramidKV's schedule (:func:`~reasonkv.cache.allocation.tables.pyramid_table`), capped for a short
    sequence: each row's own table at each eviction."""

    name = "pyramid"
    summary = "PyramidKV"
    settings = ("ragged",)
    per_length = True

    def table(self, budget, layers, kv_heads, protected, length=None, held=None):
        return pyramid_table(budget, layers, kv_heads, protected, length, held)


class Adaptive(Allocation):
    """AdaKV: every head keeps its ``ceil(alpha x K)`` best, the rest of the layer's ``K x kv_heads`` goes to the
    best of any head, chosen at each eviction (:func:`~reasonkv.cache.allocation.choose.adaptive_counts`); its
    table is the uniform split it starts from."""

    name = "adaptive"
    summary = "AdaKV: per eviction, by the policy's scores"
    settings = ("adaptive_alpha", "ragged")

    def __init__(self, adaptive_alpha: float | None = None):
        self.alpha = DEFAULT_ADAPTIVE_ALPHA if adaptive_alpha is None else adaptive_alpha

    def floor(self, budget: int) -> int:
        return adaptive_floor(self.alpha, budget)

    def counts(self, rankings, tables, budget):
        floor = self.floor(budget)
        return [adaptive_counts(r, budget * r.shape[1], floor) for r in rankings]

    def extent(self, table, budget):
        heads = table.shape[-1]  # one head takes all but the others' floors
        return budget, budget * heads - (heads - 1) * self.floor(budget)

    def options(self):
        return {"adaptive_alpha": self.alpha}

    def trace_settings(self, budget):
        return {"adaptive_alpha": self.alpha, "adaptive_floor": self.floor(budget)}


class Calibrated(Allocation):
    """From a budget file (:class:`~reasonkv.cache.allocation.tables.BudgetFile`), read when a table is made."""

    name = "calibrated"
    summary = "--budgets-file"
    settings = ("budgets_file", "ragged")

    def __init__(self, budgets_file: str | Path | None = None):
        if budgets_file is None:
            raise ValueError(
                "allocation='calibrated' needs a budget file (budgets_file=...; "
                "`reasonkv calibrate --budgets` writes one)"
            )
        self.budgets_file = str(budgets_file)

    def check(self, budget, protected):
        load_budget_file(self.budgets_file).check_total(budget, protected)

    def table(self, budget, layers, kv_heads, protected, length=None, held=None):
        return load_budget_file(self.budgets_file).table(budget, layers, kv_heads, protected)

    def options(self):
        return {"budgets_file": self.budgets_file}


#: Every allocation, by name (the first is the default).
RULES: dict[str, type[Allocation]] = {rule.name: rule for rule in (Uniform, Pyramid, Adaptive, Calibrated)}
ALLOCATIONS = tuple(RULES)

#: The settings that apply under some allocations only: setting -> (its command-line flag, those allocations).
ALLOCATION_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    setting: (flag, tuple(name for name, rule in RULES.items() if setting in rule.settings))
    for setting, flag in _FLAGS.items()
}


def allocation_class(name: object) -> type[Allocation]:
    """The allocation registered as ``name``; ``ValueError`` naming the valid ones."""
    if name not in RULES:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {name!r}")
    return RULES[name]


def allocation_rule(name: object, **settings: Any) -> Allocation:
    """The allocation ``name`` with those of ``settings`` (:data:`ALLOCATION_SETTINGS`, None: not given) that
    apply to it, besides ``ragged``; the others are ignored."""
    rule = allocation_class(name)
    return rule(**{key: settings.get(key) for key in rule.settings if key != "ragged"})


def budget_table(
    allocation: str,
    budget: int,
    layers: int,
    kv_heads: int,
    *,
    protected: int = 0,
    budgets_file: str | Path | None = None,
    length: int | None = None,
    held: int | None = None,
) -> torch.Tensor:
    """The ``[layers, kv_heads]`` budgets of the allocation named ``allocation`` (see :meth:`Allocation.table`)."""
    return allocation_rule(allocation, budgets_file=budgets_file).table(
        budget, layers, kv_heads, protected, length, held
    )


def check_allocation(allocation: object, budgets_file: object) -> None:
    """``allocation`` one of :data:`ALLOCATIONS`; ``calibrated`` with its budget file. (A budget file under
    another allocation is refused with every setting that does not apply to it: :func:`check_allocation_settings`.)"""
    allocation_rule(allocation, budgets_file=budgets_file)


def check_allocation_settings(allocation: str, **settings: Any) -> None:
    """Refuse a setting of :data:`ALLOCATION_SETTINGS` given (not None) under an allocation it does not apply to,
    naming the setting, its value, the allocation and those it applies to; check the allocation's name, that
    ``calibrated`` has its budget file, and the settings' values. Every command reaches this through
    :class:`~reasonkv.cache.CacheSpec`."""
    rule = type(allocation_rule(allocation, budgets_file=settings.get("budgets_file")))
    alpha, ragged = settings.get("adaptive_alpha"), settings.get("ragged")
    if alpha is not None and (not is_number(alpha) or not 0 <= alpha <= 1):
        raise ValueError(f"adaptive_alpha must be a number in [0, 1], got {alpha!r} (--adaptive-alpha)")
    if ragged is not None and not isinstance(ragged, bool):
        raise ValueError(f"ragged must be True or False, got {ragged!r}")
    for name, value in settings.items():
        flag, applies = ALLOCATION_SETTINGS[name]
        if value is not None and name not in rule.settings:
            raise ValueError(
                f"{name}={value!r} ({flag}) does not apply to allocation {allocation!r}: it applies to "
                f"allocation{'s' if len(applies) > 1 else ''} {', '.join(applies)} only; drop it"
            )
