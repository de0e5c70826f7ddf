"""Eviction policies and the engine-free API they are written against (torch only, no engine import).

- ``contract`` (what a policy needs, what a forward hands it, the model facts), ``view`` (what it reads
  at eviction), ``recorded`` (the recorded queries), ``attention`` (attention recomputed for a few
  queries), ``select`` (scores to rankings to kept indices), ``noise`` (keyed random draws),
  ``options`` (options typed by the dataclass fields), ``registry`` (names to classes);
- one file per method, each a dataclass registered under its name (every module here is imported, so the
  file is all a new policy needs).

A policy instance is configuration (its fields); generation state lives in the copy each cache makes
(:func:`get_policy` always returns a fresh instance).
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
