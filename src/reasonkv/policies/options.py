"""Policy options, typed by the policy dataclass's own field annotations.

Command-line text (``-o KEY=VALUE`` for every selected policy that has the option, ``-o POLICY.KEY=VALUE`` for
one; the older ``POLICY:KEY=VALUE`` with a deprecation warning) is parsed by the field's type: ``"false"`` is
``False``, ``"1,2"`` is ``(1, 2)``, ``"none"`` is ``None`` where allowed. Python values must already have
their field's type (``protect_prompt="False"`` is refused). :func:`check_fields` types every option when a
policy is made (``Policy.__post_init__``); a policy's own ``__post_init__`` then checks ranges and choices
with :func:`check_option`, :func:`check_at_least` and :func:`check_choice`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Any

from reasonkv.suggest.integers import is_int, is_number

__all__ = [
    "check_at_least",
    "check_choice",
    "check_fields",
    "check_option",
    "field_types",
    "parse_value",
    "split_option",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # annotations naming something out of reach: take values as they come
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _arms(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _describe(hint: Any) -> str:
    """``int | None`` -> ``"int or None"``; a parametrised type keeps its parameters (``tuple[int, ...]``)."""
    return " or ".join(
        "None" if arm is type(None) else str(arm) if typing.get_origin(arm) else getattr(arm, "__name__", str(arm))
        for arm in _arms(hint)
    )


def _as(arm: Any, value: Any, parse: bool) -> Any:
    """``value`` as type ``arm`` (text parsed only when ``parse``), or raise ``TypeError``/``ValueError``."""
    text = value.strip() if isinstance(value, str) and parse else None
    if arm is type(None):
        if value is None or (text is not None and text.lower() in _NONE):
            return None
    elif arm is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
    elif arm is int:
        if is_int(value):
            return value
        if text is not None:
            return int(text)
    elif arm is float:
        if is_number(value):
            return value  # an int stays an int: some options read a count where a fraction is < 1
        if text is not None:
            number = float(text)
            return int(number) if math.isfinite(number) and text.lstrip("+-").isdigit() else number
    elif arm is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
    elif typing.get_origin(arm) is tuple:
        items = [part for part in text.split(",") if part.strip()] if text is not None else value
        if isinstance(items, (list, tuple)):
            args = typing.get_args(arm)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_as(args[0], item, parse) for item in items)
            if len(items) == len(args):
                return tuple(_as(a, item, parse) for a, item in zip(args, items, strict=True))
    raise ValueError


def parse_value(cls: type, name: str, value: Any, *, parse: bool = True) -> Any:
    """``value`` for the option ``name`` of policy class ``cls``, typed; text is parsed when ``parse``."""
    hint = field_types(cls)[name]
    if hint is Any:
        return value
    arms = _arms(hint)
    # None first, so "none" never reaches str; strings last, so "8" is an int where both are allowed.
    for arm in sorted(arms, key=lambda a: (a is not type(None), a is str)):
        try:
            return _as(arm, value, parse)
        except (TypeError, ValueError):
            continue
    policy = getattr(cls, "name", "") or cls.__name__
    raise ValueError(f"{policy}: option {name}={value!r}: expected {_describe(hint)}")


def check_fields(policy: Any) -> None:
    """Refuse any field whose value is not of the field's type (the error names the option and type)."""
    cls = type(policy)
    for name in field_types(cls):
        parse_value(cls, name, getattr(policy, name), parse=False)


# -- ranges and choices: what a policy checks once check_fields has typed its options ---------------
def check_option(policy: Any, option: str, ok: bool, allowed: str) -> None:
    """Refuse ``policy.<option>`` unless ``ok``: ``"<policy>: <option> must be <allowed>, got <value>"``."""
    if not ok:
        raise ValueError(f"{policy.name}: {option} must be {allowed}, got {getattr(policy, option)!r}")


def check_at_least(policy: Any, option: str, minimum: int) -> None:
    """An integer option at least ``minimum`` ("a non-negative integer" for 0, "a positive integer" for 1)."""
    allowed = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    check_option(policy, option, getattr(policy, option) >= minimum, allowed)


def check_choice(policy: Any, option: str, choices: Sequence[Any]) -> None:
    """An option that is one of ``choices``."""
    check_option(policy, option, getattr(policy, option) in choices, f"one of {', '.join(map(str, choices))}")


def split_option(pair: str) -> tuple[str | None, str, str]:
    """``"POLICY.KEY=VALUE"`` -> ``(POLICY, KEY, VALUE)``; ``"KEY=VALUE"`` -> ``(None, KEY, VALUE)``; the old
    ``"POLICY:KEY=VALUE"`` with a warning."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"policy option {pair!r} is not KEY=VALUE")
    key, value = key.strip(), value.strip()
    target, dot, option = key.rpartition(".")
    if not dot:
        target, colon, option = key.partition(":")
        if not colon:
            return None, key.replace("-", "_"), value
        warnings.warn(
            f"-o {key}=...: POLICY:KEY is deprecated, write {target}.{option}=...", FutureWarning, stacklevel=3
        )
    return target.strip(), option.strip().replace("-", "_"), value
