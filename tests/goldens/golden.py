"""Record the golden observations, or compare the code's against them.

    python tests/goldens/golden.py record [--kind decode ...] [--match TEXT]   # writes tests/goldens/data/
    python tests/goldens/golden.py compare [--kind decode ...] [--match TEXT]  # exit 1 on any difference
    python tests/goldens/golden.py observe --ids IDS.json --out OBSERVED.json  # what the tests call

Every action runs in the pinned numeric environment (:mod:`pinned`: the script restarts itself in it).

Each kind's observations live in ``data/<kind>.json`` (case id -> observation). ``record`` merges what it
observes into those files; ``compare`` prints, per differing case, the first place it differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pinned import ensure_pinned, is_pinned  # noqa: E402

if __name__ == "__main__":
    ensure_pinned()

from cases import DATA, all_cases, observe  # noqa: E402


def load(kind: str) -> dict:
    path = DATA / f"{kind}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save(kind: str, observations: dict) -> None:
    """Write ``kind``'s observations, dropping those of cases that no longer exist."""
    known = {case["id"] for case in all_cases() if case["kind"] == kind}
    observations = {key: value for key, value in observations.items() if key in known}
    path = DATA / f"{kind}.json"
    path.write_text(json.dumps(dict(sorted(observations.items())), indent=1, sort_keys=True) + "\n")


def first_difference(expected, actual, where: str = "") -> str | None:
    """Where ``actual`` first departs from ``expected``, and how; None when they are equal."""
    if type(expected) is not type(actual) and not (
        isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and not isinstance(actual, bool)
    ):
        return f"{where or '.'}: expected {_short(expected)}, got {_short(actual)}"
    if isinstance(expected, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{where}.{key}: missing (expected {_short(expected[key])})"
            if key not in expected:
                return f"{where}.{key}: unexpected {_short(actual[key])}"
            found = first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        for index, (e, a) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(e, a, f"{where}[{index}]")
            if found:
                return found
        if len(expected) != len(actual):
            return f"{where}: {len(actual)} items, expected {len(expected)}"
        return None
    if expected != actual:
        return f"{where or '.'}: expected {_short(expected)}, got {_short(actual)}"
    return None


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 300 else text[:300] + "..."


def selected(kinds: list[str] | None, match: str | None) -> list[dict]:
    return [
        case for case in all_cases() if (not kinds or case["kind"] in kinds) and (match is None or match in case["id"])
    ]


def compare_case(case: dict, expected: dict | None, actual: dict | None = None) -> str | None:
    """The first difference of ``case``'s observation (made now unless given) from ``expected`` (None: the same)."""
    if expected is None:
        return "no golden recorded"
    if actual is None:
        if not is_pinned():
            raise RuntimeError("goldens are observed in the pinned numeric environment: run golden.py")
        actual = observe(case)
    if "refused" in expected and "refused" in actual:
        return None  # both refuse: the wording of a refusal may change
    return first_difference(expected, actual)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "compare", "list", "observe"))
    parser.add_argument("--kind", action="append", choices=("decode", "trace", "eval", "help", "plan"))
    parser.add_argument("--match", help="only cases whose id contains this text")
    parser.add_argument("--ids", type=Path, help="observe: a JSON list of the case ids to observe")
    parser.add_argument("--out", type=Path, help="observe: where to write {id: observation} as JSON")
    args = parser.parse_args()
    if args.action == "observe":
        wanted = set(json.loads(args.ids.read_text()))
        observed = {case["id"]: observe(case) for case in all_cases() if case["id"] in wanted}
        args.out.write_text(json.dumps(observed))
        return 0
    cases = selected(args.kind, args.match)
    if args.action == "list":
        print("\n".join(case["id"] for case in cases))
        return 0
    stored = {kind: load(kind) for kind in {case["kind"] for case in cases}}
    try:
        failures = _run(args.action, cases, stored)
    finally:
        if args.action == "record":
            for kind, observations in stored.items():
                save(kind, observations)
    if args.action == "record":
        return 0
    print(f"{len(cases) - failures} of {len(cases)} cases as recorded", flush=True)
    return 1 if failures else 0


def _run(action: str, cases: list[dict], stored: dict) -> int:
    """Record or compare ``cases``; the number that differ."""
    failures = 0
    for n, case in enumerate(cases, 1):
        started = time.perf_counter()
        if action == "record":
            stored[case["kind"]][case["id"]] = observe(case)
            outcome = "recorded"
        else:
            difference = compare_case(case, stored[case["kind"]].get(case["id"]))
            failures += difference is not None
            outcome = "same" if difference is None else f"DIFFERS: {difference}"
        print(f"[{n}/{len(cases)}] {case['id']}: {outcome} ({time.perf_counter() - started:.1f} s)", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
