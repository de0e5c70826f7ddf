"""A sweep record's windows by the length they end at: how the summaries set one entry beside another."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

from reasonkv.bench.rounds import same_rounds

__all__ = ["beside", "beside_plain", "by_length", "ratios", "sweeps_by_batch", "unsuffixed"]


def by_length(record: dict) -> dict[int, dict]:
    """``{length: window}`` of a length-sweep record (empty when it has none)."""
    return {int(w["length"]): w for w in record.get("windows", [])}


def ratios(mine: dict[int, dict], theirs: dict[int, dict], lengths, key: str) -> dict[int, float]:
    """``key`` of the windows ``mine`` over ``theirs``'s, at each of ``lengths``."""
    return {n: mine[n][key] / theirs[n][key] for n in lengths}


def sweeps_by_batch(records: list[dict]) -> dict[int, list[dict]]:
    """The length sweep's records by batch size, smallest first."""
    out: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record.get("mode") == "sweep":
            out[record["batch"]].append(record)
    return dict(sorted(out.items()))


def beside(record: dict, other: dict | None) -> dict[int, dict]:
    """``other``'s windows by length, if it may be set against ``record`` (measured in the same rounds)."""
    return by_length(other) if other is not None and same_rounds(record, other) else {}


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


def unsuffixed(suffix: str) -> Callable[[dict], str | None]:
    """A ``plain_of`` for :func:`beside_plain`: a variant ``POLICY<suffix>``'s plain entry ``POLICY``."""
    return lambda record: record["policy"].removesuffix(suffix) if record["policy"].endswith(suffix) else None
