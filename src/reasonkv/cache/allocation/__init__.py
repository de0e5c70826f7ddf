"""Budgets per (layer, kv-head): the allocations, one class each (:mod:`~reasonkv.cache.allocation.rules`), their
tables (:mod:`~reasonkv.cache.allocation.tables`) and the slots each head keeps under them at an eviction
(:mod:`~reasonkv.cache.allocation.choose`). Torch only."""

from reasonkv.cache.allocation.choose import adaptive_counts, adaptive_floor, keep_counted, static_counts
from reasonkv.cache.allocation.rules import (
    ALLOCATION_SETTINGS,
    ALLOCATIONS,
    DEFAULT_ADAPTIVE_ALPHA,
    RULES,
    Adaptive,
    Allocation,
    Calibrated,
    Pyramid,
    Uniform,
    allocation_class,
    allocation_rule,
    budget_table,
    check_allocation,
    check_allocation_settings,
)
from reasonkv.cache.allocation.tables import PYRAMID_BETA, BudgetFile, apportion, load_budget_file, pyramid_table

__all__ = [
    "ALLOCATIONS",
    "ALLOCATION_SETTINGS",
    "DEFAULT_ADAPTIVE_ALPHA",
    "PYRAMID_BETA",
    "RULES",
    "Adaptive",
    "Allocation",
    "BudgetFile",
    "Calibrated",
    "Pyramid",
    "Uniform",
    "adaptive_counts",
    "adaptive_floor",
    "allocation_class",
    "allocation_rule",
    "apportion",
    "budget_table",
    "check_allocation",
    "check_allocation_settings",
    "keep_counted",
    "load_budget_file",
    "pyramid_table",
    "static_counts",
]
