"""LiveCodeBench's release files, read as they are published (the ``code_generation_lite`` schema).

A release file (``test.jsonl`` ... ``test6.jsonl``) has one problem per line: ``question_title``,
``question_id``, ``question_content``, ``platform``, ``contest_id``, ``contest_date``, ``starter_code``,
``difficulty``, ``public_test_cases`` and ``private_test_cases`` (lists of ``{"input", "output", "testtype"}``,
as JSON or compressed: base64 of zlib of a pickle of the JSON string) and ``metadata`` (JSON; a ``func_name``
makes a ``code-function`` problem, one JSON argument per input line; else ``code-stdio``). The
compressed tests are never given to :func:`pickle.loads`: :class:`_TestsUnpickler` resolves no global name, so
a pickle that names a class or a function (how a pickle runs code) is refused. :func:`in_window` selects
problems by contest date as LiveCodeBench's leaderboard does (both days included).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import io
import json
import pickle
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_TESTS_BYTES", "decode_tests", "in_window", "is_livecodebench", "livecodebench_fields", "parse_day"]

_REQUIRED = ("question_id", "question_content", "public_test_cases", "private_test_cases")
#: Most bytes the compressed tests of one problem may expand to.
MAX_TESTS_BYTES = 1 << 30


def is_livecodebench(row: Mapping[str, Any]) -> bool:
    return "question_content" in row and "public_test_cases" in row


class _TestsUnpickler(pickle.Unpickler):
    """Builds only what needs no global name (str, bytes, numbers, list, tuple, dict, set)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent reference")


def _inflate(data: bytes) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, MAX_TESTS_BYTES + 1)
    if len(out) > MAX_TESTS_BYTES or inflater.unconsumed_tail:
        raise ValueError(f"they expand to more than {MAX_TESTS_BYTES} bytes")
    return out


def decode_tests(value: Any, what: str) -> list[dict[str, Any]]:
    """A test-case field as a list of dicts: a JSON list, or its compressed form (see the module docstring).

    ``what`` names the problem and field in errors.
    """
    if isinstance(value, list):
        tests = value
    elif isinstance(value, str):
        try:
            tests = json.loads(value)
        except json.JSONDecodeError:
            tests = _decode_compressed(value, what)
    else:
        raise ValueError(f"{what}: expected a JSON string, got {type(value).__name__}")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(f"{what}: the decoded tests are not JSON ({error.msg})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ValueError(f"{what}: expected a list of test objects, got {type(tests).__name__}")
    for number, test in enumerate(tests):
        if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
            raise ValueError(f"{what}: test {number} needs string 'input' and 'output'")
    return tests


def _decode_compressed(value: str, what: str) -> Any:
    try:
        packed = _inflate(base64.b64decode(value.encode("ascii"), validate=True))
    except (binascii.Error, UnicodeEncodeError, zlib.error, ValueError) as error:
        raise ValueError(f"{what}: neither JSON nor base64/zlib-compressed tests ({error})") from None
    try:
        return _TestsUnpickler(io.BytesIO(packed)).load()
    except pickle.UnpicklingError as error:
        raise ValueError(f"{what}: refused a pickle that is not plain data ({error}); nothing in it was run") from None
    except Exception as error:  # noqa: BLE001 - any malformed pickle is the file's fault, named as such
        raise ValueError(f"{what}: unreadable pickle ({type(error).__name__}: {error})") from None


def _json_field(row: Mapping[str, Any], name: str, what: str) -> Any:
    value = row.get(name)
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: field {name!r} is not JSON ({error.msg})") from None


def parse_day(text: str, what: str) -> dt.date:
    """``YYYY-MM-DD`` (or an ISO date-time, of which the day counts)."""
    try:
        return dt.date.fromisoformat(str(text)[:10])
    except ValueError:
        raise ValueError(f"{what}: expected a date YYYY-MM-DD, got {text!r}") from None


def livecodebench_fields(row: Mapping[str, Any], where: str, source: str) -> dict[str, Any]:
    """The :class:`~reasonkv.eval.datasets.Problem` fields of a LiveCodeBench row."""
    for name in _REQUIRED:
        if row.get(name) in (None, ""):
            raise ValueError(f"{where}: LiveCodeBench row without {name!r}")
    what = f"{where} (LiveCodeBench problem {row['question_id']})"
    tests = decode_tests(row["public_test_cases"], f"{what}, public_test_cases")
    public = len(tests)
    tests += decode_tests(row["private_test_cases"], f"{what}, private_test_cases")
    if not tests:
        raise ValueError(f"{what}: no test cases")
    metadata = _json_field(row, "metadata", what)
    function = metadata.get("func_name") if isinstance(metadata, dict) else None
    types = {t.get("testtype", "functional" if function else "stdin") for t in tests}
    if types - {"functional", "stdin"} or (function and "stdin" in types) or (not function and "functional" in types):
        raise ValueError(f"{what}: test types {sorted(types)} do not match func_name {function!r}")
    date = row.get("contest_date")
    extra = {
        "title": row.get("question_title"),
        "platform": row.get("platform"),
        "contest_id": row.get("contest_id"),
        "contest_date": None if date in (None, "") else str(date),
        "difficulty": row.get("difficulty"),
        "starter_code": row.get("starter_code") or "",
        "tests": [{"input": t["input"], "output": t["output"]} for t in tests],
        "public_tests": public,
        "prelude": True,  # LiveCodeBench runs every solution after its usual imports
    }
    if function:
        extra["function"] = str(function)
    platform = row.get("platform") or "?"
    return {
        "id": str(row["question_id"]),
        "problem": str(row["question_content"]),
        "answer": "",
        "source": f"LiveCodeBench {platform} {row.get('contest_id') or ''}".strip() + f" ({source})",
        "kind": "code-function" if function else "code-stdio",
        "solution": None,
        "extra": extra,
    }


def in_window(problems: Sequence[Any], after: dt.date | None, before: dt.date | None, dataset: str) -> list[Any]:
    """The problems whose contest day lies in ``[after, before]`` (either end open when None)."""
    kept = []
    for problem in problems:
        date = problem.extra.get("contest_date")
        if not date:
            raise ValueError(
                f"--after/--before select problems by contest date; {dataset} problem {problem.id!r} has none"
            )
        day = parse_day(date, f"{dataset} problem {problem.id!r}")
        if (after is None or day >= after) and (before is None or day <= before):
            kept.append(problem)
    return kept
