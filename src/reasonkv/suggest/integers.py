"""Whole numbers a user gives (counts, sizes, seeds): an ``int`` and never a ``bool`` (``True`` is 1 to
Python, never a count to a user)."""

from __future__ import annotations

__all__ = ["check_int", "is_int", "is_number"]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None) -> None:
    """Raise ``ValueError`` naming the setting ``name``, its ``value`` and what is allowed, unless ``value`` is
    an integer (:func:`is_int`) of at least ``minimum`` (any integer when None)."""
    if not is_int(value) or (minimum is not None and value < minimum):
        allowed = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
        raise ValueError(f"{name} must be {allowed.get(minimum, f'an integer >= {minimum}')}, got {value!r}")
