"""Code problems in a dataset file: which rows are code, and the fields of their :class:`Problem`.

Three row formats are read into the same fields (graded by :mod:`reasonkv.eval.code`): HumanEval's (``task_id``,
``prompt``, ``test`` defining ``check(candidate)``, ``entry_point``), LiveCodeBench's
(:mod:`reasonkv.eval.livecodebench`), and reasonkv's own ``code-function`` and ``code-stdio`` rows
(docs/sandbox.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from reasonkv.eval.extraction import CODE_KINDS
from reasonkv.eval.livecodebench import is_livecodebench, livecodebench_fields
from reasonkv.suggest.integers import is_number

__all__ = ["CODE_KINDS", "code_fields", "is_humaneval"]

_HUMANEVAL = ("task_id", "prompt", "test", "entry_point")


def is_humaneval(row: Mapping[str, Any]) -> bool:
    return all(isinstance(row.get(name), str) for name in _HUMANEVAL)


def _text(row: Mapping[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def code_fields(row: Mapping[str, Any], where: str, source: str) -> dict[str, Any] | None:
    """The :class:`~reasonkv.eval.datasets.Problem` fields of a code row, or None for any other row.

    ``where`` names the file and line in errors; ``source`` is the default ``source`` (the file name).
    """
    if is_livecodebench(row):
        return livecodebench_fields(row, where, source)
    if is_humaneval(row):
        return {
            "id": _text(row, "task_id", where),
            "problem": _text(row, "prompt", where),
            "answer": str(row.get("canonical_solution") or ""),
            "source": source,
            "kind": "code-function",
            "solution": None,
            "extra": {"entry_point": _text(row, "entry_point", where), "test": _text(row, "test", where)},
        }
    kind = row.get("kind")
    if kind not in CODE_KINDS:
        return None
    fields = {
        "id": str(row.get("id") if row.get("id") is not None else _text(row, "id", where)),
        "problem": _text(row, "problem", where),
        "answer": str(row.get("answer") or ""),
        "source": str(row.get("source") or source),
        "kind": kind,
        "solution": None,
    }
    if kind == "code-function" and ("test" in row or "entry_point" in row):
        fields["extra"] = {"entry_point": _text(row, "entry_point", where), "test": _text(row, "test", where)}
    elif kind == "code-function":
        starter = row.get("starter_code") or ""
        if not isinstance(starter, str):
            raise ValueError(f"{where}: field 'starter_code' must be a string")
        fields["extra"] = {
            "function": _text(row, "function", where),
            "starter_code": starter,
            "tests": [_function_test(t, f"{where}, test {i}") for i, t in enumerate(_tests(row, where))],
        }
    else:
        fields["extra"] = {
            "tests": [_stdio_test(t, f"{where}, test {i}") for i, t in enumerate(_tests(row, where))],
            "tolerance": _tolerance(row.get("tolerance"), where),
        }
    return fields


def _tests(row: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, Mapping) for t in tests):
        raise ValueError(f"{where}: field 'tests' must be a non-empty list of {{'input', 'output'}} objects")
    return tests


def _function_test(test: Mapping[str, Any], where: str) -> dict[str, str]:
    """LiveCodeBench's representation: one JSON argument per input line, the output as JSON."""
    args = test.get("input")
    if not isinstance(args, list):
        raise ValueError(f"{where}: 'input' must be the list of the function's arguments, got {args!r}")
    if "output" not in test:
        raise ValueError(f"{where}: missing 'output'")
    try:
        return {"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(test["output"])}
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: arguments and output must be JSON values ({error})") from None


def _stdio_test(test: Mapping[str, Any], where: str) -> dict[str, str]:
    if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
        raise ValueError(f"{where}: 'input' and 'output' must be strings (standard input and expected output)")
    return {"input": test["input"], "output": test["output"]}


def _tolerance(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: field 'tolerance' must be a non-negative number, got {value!r}")
    return float(value)
