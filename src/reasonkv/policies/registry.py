"""The policy registry: names to policy classes, fresh instances, and typed options from text."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from reasonkv.policies.base import Policy
from reasonkv.policies.options import field_types, parse_value, split_option
from reasonkv.policies.selective import PROTECTION
from reasonkv.suggest import did_you_mean

__all__ = ["get_policy", "list_policies", "options_by_policy", "parse_options", "policy_class", "register"]

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
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    if name not in _REGISTRY:
        hint = did_you_mean(name, _REGISTRY)
        raise ValueError(f"unknown policy {name!r}; {hint}valid policies: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_policy(name: str | Policy, **options) -> Policy:
    """A new policy instance by name (or a fresh copy of an instance), hyper-parameters overridden by ``options``.

    Option values must have their field's type (``protect_prompt="False"`` is refused, never taken as
    true; :func:`parse_options` turns command-line text into typed values), checked when the policy is
    made (``Policy.__post_init__``). Raises ``ValueError`` naming the bad name (and listing the valid
    ones) or the bad option (and listing the policy's options, or what it allows).
    """
    if isinstance(name, Policy):
        return dataclasses.replace(name, **_checked(type(name), options))
    cls = policy_class(name)
    return cls(**_checked(cls, options))


def _checked(cls: type[Policy], options: dict) -> dict:
    unknown = sorted(set(options) - set(field_types(cls)))
    if unknown:
        raise _no_option(cls, {name: options[name] for name in unknown})
    return options


def _no_option(cls: type[Policy], unknown: dict[str, Any]) -> ValueError:
    """The error for options ``cls`` does not have (names to values), listing those it has; an option that
    protects tokens from eviction, given to a selection policy, says that selection policies have none."""
    known = sorted(field_types(cls))
    protecting = [name for name in unknown if cls.selects and name in PROTECTION]
    if protecting:
        name = protecting[0]
        return ValueError(
            f"policy {cls.name!r} has no option {name}={unknown[name]}: {name} protects tokens from eviction, and "
            f"selection policies hold every token, so they have no such option; options: {', '.join(known)}"
        )
    hint = did_you_mean(next(iter(unknown)), known) if len(unknown) == 1 else ""
    named = ", ".join(map(repr, unknown))
    return ValueError(f"policy {cls.name!r} has no option {named}; {hint}options: {', '.join(known)}")


def options_by_policy(policies: Sequence[str], pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Typed options per policy from ``KEY=VALUE`` / ``POLICY.KEY=VALUE`` strings.

    ``KEY=VALUE`` goes to every listed policy that has the option (an error if none has it; the
    full cache, which evicts nothing, takes it only when it is the one policy listed);
    ``POLICY.KEY=VALUE`` goes to that policy, which must be listed.
    """
    classes = {name: policy_class(name) for name in policies}
    out: dict[str, dict[str, Any]] = {name: {} for name in policies}
    for pair in pairs:
        target, option, value = split_option(pair)
        if target is not None:
            if target not in classes:
                raise ValueError(
                    f"option {pair!r} names policy {target!r}, which is not selected ({', '.join(policies)})"
                )
            takers = [target]
        elif len(classes) == 1:
            takers = list(classes)
        else:
            takers = [name for name, cls in classes.items() if option in field_types(cls) and cls.evicts]
        for name in takers:
            if option not in field_types(classes[name]):
                raise _no_option(classes[name], {option: value})
            out[name][option] = parse_value(classes[name], option, value)
        if not takers:
            offered = {o for name, cls in classes.items() if cls.evicts for o in field_types(cls)}
            hint = did_you_mean(option, offered)
            raise ValueError(f"no selected policy has an option {option!r}; {hint}(policies: {', '.join(policies)})")
    return out


def parse_options(policy: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``["sinks=8", "protect_prompt=false"]`` -> typed keyword arguments for ``get_policy(policy, ...)``.

    ``POLICY.KEY=VALUE`` is accepted when ``POLICY`` is ``policy``.
    """
    return options_by_policy([policy], pairs)[policy]
