"""Interleaved rounds: every entry of a group measured once per round, A B C A B C ..., the median round kept.

A GPU's clock and a shared host's load drift over minutes, so entries measured one after another compare the
machine's state as much as the entries; measuring each entry once per round spreads that drift over all of
them. Two entries' figures are compared only when both come from the same rounds (:func:`same_rounds`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from reasonkv.suggest.integers import check_int

__all__ = ["combine_rounds", "interleaved", "run_rounds", "same_rounds", "spread", "summed_compile"]

Entry = TypeVar("Entry", bound=Hashable)


def interleaved(entries: Sequence[Entry], rounds: int) -> list[tuple[int, Entry]]:
    """``(round, entry)`` in measuring order: every entry in round 0, then every entry in round 1, ..."""
    check_int("rounds", rounds, 1)
    return [(r, entry) for r in range(rounds) for entry in entries]


def run_rounds(
    entries: Sequence[Entry],
    rounds: int,
    measure: Callable[[Entry, int], dict],
    finish: Callable[[Entry, list[dict]], None],
    *,
    failed: Callable[[Entry, Exception], None],
    collected: dict[Entry, list[dict]] | None = None,
) -> dict[Entry, list[dict]]:
    """Measure ``entries`` in ``rounds`` interleaved rounds; returns each entry's rounds.

    ``measure(entry, round)`` returns one round's data; ``finish(entry, datas)`` gets an entry's rounds as
    soon as its last one is in. An entry whose ``measure`` raises an ``Exception`` is handed to ``failed`` and
    left out of the later rounds (the others go on); anything else (``KeyboardInterrupt``) propagates, and
    ``collected`` (filled as the rounds come in, if given) then holds the rounds measured so far.
    """
    collected = {} if collected is None else collected
    for entry in entries:
        collected[entry] = []
    dropped: set[Entry] = set()
    for index, entry in interleaved(entries, rounds):
        if entry in dropped:
            continue
        try:
            data = measure(entry, index)
        except Exception as error:  # one failing entry must not cost the others their numbers
            dropped.add(entry)
            failed(entry, error)
            continue
        collected[entry].append(data)
        if index == rounds - 1:
            finish(entry, collected[entry])
    return collected


def spread(values: Sequence[float]) -> dict:
    """Minimum, first quartile, median, third quartile and maximum of ``values`` (the quartiles interpolated;
    with one value all five are it)."""
    if not values:
        raise ValueError("a spread needs at least one value")
    ordered = sorted(values)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"min": ordered[0], "q1": q1, "median": statistics.median(ordered), "q3": q3, "max": ordered[-1]}


def _median_round(windows: list[dict]) -> int:
    """Index of the round whose mean step time is the median one (the lower of the two middle ones for an even
    count, so that the figure is a round's own, with its split and memory)."""
    order = sorted(range(len(windows)), key=lambda i: windows[i]["step_mean_s"])
    return order[(len(order) - 1) // 2]


def _combine_window(windows: list[dict]) -> dict:
    pick = _median_round(windows)
    steps = [w["step_mean_s"] for w in windows]
    out = dict(windows[pick])
    out["rounds"] = {
        "count": len(windows),
        "median_round": pick,
        "step_mean_s": steps,
        "tokens_per_s": [w["tokens_per_s"] for w in windows],
        "gpu_clock_mhz": [w.get("gpu_clock_mhz") for w in windows],
        "peak_memory_bytes": [w.get("peak_memory_bytes") for w in windows],
    }
    out["step_mean_spread_s"] = spread(steps)
    return out


def combine_rounds(datas: list[dict]) -> dict:
    """One length sweep's rounds (each ``{"windows": [...], ...}``) as one record of the same layout.

    At each length the median round's window is kept whole, with ``rounds`` (every round's figures) and
    ``step_mean_spread_s``; lengths not reached by every round keep the rounds that reached them. The rest is
    the round that is the median at the longest length; ``compile`` adds up every round's compilations and
    warm-up (the first round compiles, the others reuse its graphs).
    """
    if not datas:
        raise ValueError("no rounds to combine")
    by_length: dict[int, list[dict]] = {}
    for data in datas:
        for window in data["windows"]:
            by_length.setdefault(int(window["length"]), []).append(window)
    windows = [_combine_window(by_length[length]) for length in sorted(by_length)]
    longest = max(by_length)
    reaching = [d for d in datas if any(int(w["length"]) == longest for w in d["windows"])]
    base = reaching[_median_round(by_length[longest])]  # by_length[longest]: their windows there, in their order
    out = {**base, "windows": windows}
    compiles = [d["compile"] for d in datas if d.get("compile")]
    if compiles:
        out["compile"] = summed_compile(compiles)
    return out


def summed_compile(compiles: list[dict]) -> dict:
    """The first of several runs' ``compile`` records, with every run's compilations and warm-up added up."""
    return {
        **compiles[0],
        "compilations": sum(c.get("compilations") or 0 for c in compiles),
        "warmup_seconds": sum(c.get("warmup_seconds") or 0.0 for c in compiles),
    }


def same_rounds(a: dict, b: dict) -> bool:
    """Whether two records' figures may be set against each other: both measured in the same interleaved
    rounds (the same ``rounds_group``), or both from before rounds existed (neither has one)."""
    return a.get("rounds_group") == b.get("rounds_group")
