"""Eviction policies and the engine-free API they are written against (torch only, no engine import).

The shared modules: ``contract`` (needs, steps, model facts), ``view`` (what a policy reads at eviction),
``recorded``, ``attention``, ``select``, ``noise``, ``options`` and ``registry``; then one file per method, a
dataclass registered under its name. A policy instance is configuration; generation state lives in the
fresh copy each cache makes (:func:`get_policy`).
"""

from __future__ import annotations

import importlib
import pkgutil

from reasonkv.policies.base import Policy
from reasonkv.policies.contract import ModelInfo, Needs, Step
from reasonkv.policies.options import check_fields
from reasonkv.policies.registry import (
    get_policy,
    list_policies,
    options_by_policy,
    parse_options,
    policy_class,
    register,
)
from reasonkv.policies.view import EvictionView

# Every module of this package is imported, so a policy's file registers it: a new policy is one file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "EvictionView",
    "ModelInfo",
    "Needs",
    "Policy",
    "Step",
    "check_fields",
    "get_policy",
    "list_policies",
    "options_by_policy",
    "parse_options",
    "policy_class",
    "register",
]
