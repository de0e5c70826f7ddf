"""The code part of a report: how each (policy, budget)'s programs ended (``code_outcome``, see
:mod:`reasonkv.eval.code`), per row and per problem, and the sandbox's mean wall time per test run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["OUTCOME_ORDER", "code_summary", "outcome_table"]

OUTCOME_ORDER = ("passed", "wrong-answer", "runtime-error", "timeout", "no-code")


def code_summary(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The ``code`` entry of a report row from its generation records (``{}`` without code records)."""
    coded = [r for r in records if r.get("code_outcome")]
    if not coded:
        return {}
    outcomes = Counter(str(r["code_outcome"]) for r in coded)
    problems: dict[str, Counter] = {}
    for r in coded:
        problems.setdefault(str(r.get("problem_id")), Counter())[str(r["code_outcome"])] += 1
    runs = sum(int(r.get("sandbox_runs") or 0) for r in coded)
    seconds = sum(float(r.get("sandbox_seconds") or 0.0) for r in coded)
    order = [*OUTCOME_ORDER, *sorted(set(outcomes) - set(OUTCOME_ORDER))]
    return {
        "outcomes": {name: outcomes[name] for name in order},
        "problems": {pid: {name: c[name] for name in order if c[name]} for pid, c in problems.items()},
        "runs": runs,
        "seconds_per_run": seconds / runs if runs else math.nan,
    }


def outcome_table(rows: Sequence[Any]) -> list[str]:
    """Markdown lines: a table of the rows that have code records (nothing when none has)."""
    coded = [r for r in rows if r.code]
    if not coded:
        return []
    lines = [
        "",
        "Code: a problem is solved when every hidden test passes; the first test, in order, that does not pass "
        "gives the outcome. Runs: sandbox runs; s/run: their mean wall time, the sandbox's set-up included.",
        "",
        "| policy | budget | passed | wrong answer | runtime error | timeout | no code | runs | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in coded:
        counts = [str(r.code["outcomes"].get(name, 0)) for name in OUTCOME_ORDER]
        cost = r.code["seconds_per_run"]
        cost = "—" if math.isnan(cost) else f"{cost:.3f}"
        budget = "—" if r.budget is None else str(r.budget)
        lines.append(f"| {r.policy} | {budget} | " + " | ".join(counts) + f" | {r.code['runs']} | {cost} |")
    return lines
