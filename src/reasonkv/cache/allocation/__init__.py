"""Budgets per (layer, kv-head): the allocations' tables (:mod:`~reasonkv.cache.allocation.tables`) and the
slots each head keeps under them at an eviction (:mod:`~reasonkv.cache.allocation.choose`). Torch only."""

from reasonkv.cache.allocation.choose import adaptive_counts, adaptive_floor, keep_counted, static_counts
from reasonkv.cache.allocation.tables import (
    ALLOCATIONS,
    PYRAMID_BETA,
    BudgetFile,
    apportion,
    budget_table,
    check_allocation,
    load_budget_file,
    pyramid_table,
)

__all__ = [
    "ALLOCATIONS",
    "PYRAMID_BETA",
    "BudgetFile",
    "adaptive_counts",
    "adaptive_floor",
    "apportion",
    "budget_table",
    "check_allocation",
    "keep_counted",
    "load_budget_file",
    "pyramid_table",
    "static_counts",
]
