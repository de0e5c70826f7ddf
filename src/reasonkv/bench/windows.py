"""A sweep record's windows by the length they end at: how the summaries set one entry beside another."""

from __future__ import annotations

__all__ = ["by_length"]


def by_length(record: dict) -> dict[int, dict]:
    """``{length: window}`` of a length-sweep record (empty when it has none)."""
    return {int(w["length"]): w for w in record.get("windows", [])}
