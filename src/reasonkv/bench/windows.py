"""A sweep record's windows by the length they end at: how the summaries set one entry beside another."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from reasonkv.bench.rounds import same_rounds

__all__ = ["beside_plain", "by_length"]


def by_length(record: dict) -> dict[int, dict]:
    """``{length: window}`` of a length-sweep record (empty when it has none)."""
    return {int(w["length"]): w for w in record.get("windows", [])}


def beside_plain(records: list[dict], plain_of: Callable[[dict], str | None]) -> Iterator[tuple]:
    """``(variant, plain, its windows, plain's windows, lengths both reached)`` for each sweep record whose
    ``plain_of`` names its plain entry, that entry of the same batch measured in the same rounds."""
    sweeps = [r for r in records if r.get("mode") == "sweep"]
    for record in sweeps:
        policy = plain_of(record)
        if policy is None:
            continue
        same = [r for r in sweeps if r["batch"] == record["batch"] and same_rounds(r, record)]  # ratios: same rounds
        plain = next((r for r in same if r["policy"] == policy), None)
        if plain is not None:
            mine, theirs = by_length(record), by_length(plain)
            yield record, plain, mine, theirs, sorted(set(mine) & set(theirs))
