"""Did-you-mean for names a user types (policies, policy options, datasets, models): an "unknown name" error
names the likely intended name first, then the allowed ones."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_matches", "did_you_mean"]

# difflib's default cutoff: 'h2p' finds 'h2o' (0.67), 'nope' finds nothing among the policies.
CUTOFF = 0.6


def close_matches(name: object, choices: Iterable[str], *, limit: int = 3, cutoff: float = CUTOFF) -> list[str]:
    """The choices closest to ``name`` (best first), compared without case; empty when none is close."""
    if not isinstance(name, str) or not name:
        return []
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    found = difflib.get_close_matches(name.lower(), list(by_lower), n=limit, cutoff=cutoff)
    return [by_lower[match] for match in found if by_lower[match] != name]


def did_you_mean(name: object, choices: Iterable[str], *, cutoff: float = CUTOFF) -> str:
    """``"did you mean 'h2o'? "`` (or ``'a' or 'b'``), or ``""`` when no choice is close to ``name``; it ends
    with a space, to read in front of the allowed list."""
    found = close_matches(name, choices, cutoff=cutoff)
    if not found:
        return ""
    return f"did you mean {' or '.join(map(repr, found))}? "
