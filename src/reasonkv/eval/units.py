"""Units of work of an evaluation grid, their expected cost, and their split across processes.

A *unit* is one record's worth of work: a generation (dataset, problem, cell, sample) or a fidelity replay
(dataset, problem, evicting cell). :func:`assign` splits them across ``count`` shards deterministically (every
process computes the same split from the grid alone), balanced by expected cost: each *stratum* (the units of
one dataset, kind and cell) is dealt evenly across shards, so long-answer datasets and big budgets are spread
whatever the answers' true lengths; the remainders go to the shards with the least expected cost
(:func:`decode_cost`: decoding the token limit with a cache capped at ``K + B``), costliest strata first. The
fidelity replays of a problem follow its greedy full-cache generation when the grid has one (to reuse its
trace exactly as a single process would), else travel together (one trace to regenerate).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["STEP_COST", "Unit", "assign", "decode_cost", "grid_units", "sample_seed", "unit_cost"]


def sample_seed(base_seed: int, problem_id: str, sample: int) -> int:
    """The seed of sample ``sample`` of problem ``problem_id``: the first 31 bits of a SHA-256."""
    digest = hashlib.sha256(f"{int(base_seed)}/{problem_id}/{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


#: The cost of a decode step apart from attention, in cached tokens attended to (an assumption: a
#: step reads the weights once; what differs between units is how many tokens it attends to).
STEP_COST = 1024


@dataclass(frozen=True, order=True)
class Unit:
    """One record's worth of work; ``cell`` indexes the grid's cells."""

    kind: str  # "generation" | "fidelity"
    dataset: str
    problem: str
    cell: int
    sample: int = 0


def decode_cost(tokens: int, cap: int | None) -> float:
    """Expected cost of decoding ``tokens`` tokens with a cache of at most ``cap`` tokens (``None``: no cap)."""
    if cap is None or tokens <= cap:
        return tokens * STEP_COST + tokens * (tokens + 1) / 2
    return tokens * STEP_COST + cap * (cap + 1) / 2 + (tokens - cap) * cap


def _cap(cell: Any) -> int | None:
    return None if cell.budget is None else cell.budget + (cell.buffer or 0)


def grid_units(
    datasets: Sequence[tuple[str, Sequence[Any]]],
    cells: Sequence[Any],
    samples: Mapping[tuple[str, int], int],
    fidelity: bool,
    generation: bool = True,
) -> list[Unit]:
    """Every unit of the grid, in grid order; ``samples[(dataset, cell index)]`` samples per problem.
    ``generation`` False: evicting cells generate nothing (fidelity only; ``full`` still generates)."""
    units = []
    for name, problems in datasets:
        for index, cell in enumerate(cells):
            if not generation and cell.evicts:
                continue
            units += [Unit("generation", name, p.id, index, s) for p in problems for s in range(samples[(name, index)])]
        if fidelity:
            for index, cell in enumerate(cells):
                if cell.evicts:
                    units.extend(Unit("fidelity", name, problem.id, index) for problem in problems)
    return units


def unit_cost(unit: Unit, cells: Sequence[Any], max_new_tokens: int, fidelity_tokens: int) -> float:
    cell = cells[unit.cell]
    if unit.kind == "generation":
        return decode_cost(max_new_tokens, _cap(cell))
    return decode_cost(fidelity_tokens, None) + decode_cost(fidelity_tokens, _cap(cell))  # both caches replay


def assign(
    units: Sequence[Unit], cells: Sequence[Any], count: int, *, max_new_tokens: int, fidelity_tokens: int
) -> dict[Unit, int]:
    """The shard (``0 .. count - 1``) of every unit; the same for every process that asks."""
    full = {index for index, cell in enumerate(cells) if not cell.evicts}
    heads = {(u.dataset, u.problem): u for u in units if u.kind == "generation" and u.cell in full and u.sample == 0}
    # items: (stratum, members, cost); a fidelity replay joins its problem's full-cache generation
    items: dict[Unit, list[Unit]] = {}
    loose: dict[tuple[str, str], list[Unit]] = {}
    for unit in units:
        head = heads.get((unit.dataset, unit.problem)) if unit.kind == "fidelity" else None
        if unit.kind == "generation":
            items.setdefault(unit, []).insert(0, unit)
        elif head is not None:
            items.setdefault(head, []).append(unit)
        else:
            loose.setdefault((unit.dataset, unit.problem), []).append(unit)
    strata: dict[tuple, list[tuple[list[Unit], float]]] = {}
    for first, members in [*items.items(), *((group[0], group) for group in loose.values())]:
        stratum = (first.dataset, first.kind, first.cell)
        cost = sum(unit_cost(u, cells, max_new_tokens, fidelity_tokens) for u in members)
        strata.setdefault(stratum, []).append((members, cost))
    load = [0.0] * count
    owner: dict[Unit, int] = {}
    ordered = sorted(strata.values(), key=lambda group: -sum(cost for _, cost in group))  # stable: grid order on ties
    for group in ordered:
        dealt = [0] * count
        for members, cost in sorted(group, key=lambda item: -item[1]):
            rank = min(range(count), key=lambda r: (dealt[r], load[r], r))
            dealt[rank] += 1
            load[rank] += cost
            for unit in members:
                owner[unit] = rank
    return owner
