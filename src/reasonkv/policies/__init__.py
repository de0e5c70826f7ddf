"""Eviction policies: one file per method, each a dataclass registered under its name.

A policy instance is configuration (its fields); generation state lives in the copy each cache makes
(:func:`get_policy` always returns a fresh instance). Everything here and below (``select``,
``attention``, ``contract``, ``view``, ``recorded``) is torch only: no engine import.
"""

from __future__ import annotations

import dataclasses

from reasonkv.contract import ModelInfo, Needs, Step
from reasonkv.policies.base import Policy
from reasonkv.policies.options import check_fields, options_by_policy, parse_options
from reasonkv.view import EvictionView

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available to :func:`get_policy` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def list_policies() -> list[str]:
    """Names of every registered policy."""
    _load_builtin()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_policy(name: str | Policy, **options) -> Policy:
    """A new policy instance by name (or a fresh copy of an instance), hyper-parameters overridden by ``options``.

    Option values are typed by the policy's fields (strings are parsed: ``protect_prompt="False"``
    is ``False``). Raises ``ValueError`` naming the bad name (and listing the valid ones) or the bad
    option (and listing the policy's options, or the type it expects).
    """
    if isinstance(name, Policy):
        policy = dataclasses.replace(name, **_checked(type(name), options))
    else:
        cls = policy_class(name)
        policy = cls(**_checked(cls, options))
    check_fields(policy)
    return policy


def _checked(cls: type[Policy], options: dict) -> dict:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"policy {cls.name!r} has no option {', '.join(map(repr, unknown))}; options: {', '.join(sorted(known))}"
        )
    return options


def _load_builtin() -> None:
    # Importing the modules registers their policies; kept lazy so `select`/`base` import alone.
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_") and module.name not in ("base", "common", "options"):
            importlib.import_module(f"{__name__}.{module.name}")


__all__ = [
    "EvictionView",
    "ModelInfo",
    "Needs",
    "Policy",
    "Step",
    "get_policy",
    "list_policies",
    "options_by_policy",
    "parse_options",
    "policy_class",
    "register",
]
