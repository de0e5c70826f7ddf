"""Grading code answers by running them, every test in the sandbox (:mod:`reasonkv.sandbox`).

The program is the last complete fenced Python block after the reasoning (``</think>``), else in the whole text
(``from_thinking``); for a function prompt (HumanEval) the prompt comes first, and an output without any fence is
the function's body up to the first line that leaves the function (HumanEval's own cut). A HumanEval problem is
one run of ``check(entry_point)``; a function problem one run per test, its result compared with ``==`` (a
tuple counts as a list); a standard-input problem one run per test, compared as LiveCodeBench compares
(:func:`stdio_equal`). A run passes only when the harness wrote its line (a random marker and the verdict) last:
a program that exits before the tests ran, or closes its output, fails. The verdict is that of the first test, in
test order, that does not pass (``tests_passed`` counts those before it), so running the tests in parallel on
``workers`` sandboxes changes no result. The outcomes and the record fields: docs/sandbox.md.
"""

from __future__ import annotations

import ast
import os
import re
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from reasonkv.eval.datasets import Problem
from reasonkv.eval.extraction import find_code
from reasonkv.eval.prompts import strip_thinking
from reasonkv.sandbox import RunResult, Sandbox
from reasonkv.sandbox.limits import check_memory, check_timeout
from reasonkv.suggest.integers import check_int

__all__ = ["OUTCOMES", "CodeGrade", "CodeGrader", "program_for", "stdio_equal"]

OUTCOMES = ("passed", "wrong-answer", "runtime-error", "timeout", "no-code")

# What LiveCodeBench's harness imports before every solution (LeetCode's environment does the same).
_MODULES = ["string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random"]
_MODULES += ["statistics", "itertools", "functools", "operator", "io", "sys", "json"]
# Star imports shadow builtins (math's pow, re's compile): "from builtins import *" restores them.
_STARRED = [*_MODULES, "builtins", "typing"]
PRELUDE = "".join(f"from {m} import *\n" for m in _STARRED) + "".join(f"import {m}\n" for m in _MODULES)
PRELUDE += "sys.setrecursionlimit(50000)\n"

_DETAIL_CHARS = 300

# A harnessed run: the solution in a namespace of its own, a check that sets _verdict, and the verdict written last.
_HARNESS = """\
import json as _json, os as _os, sys as _sys
_space = {{"__name__": "solution", "__builtins__": __builtins__}}
exec(compile({program!r}, "solution.py", "exec"), _space)
{check}_sys.stdout.flush()
_os.write(1, ("\\n" + {mark!r} + " " + _verdict + "\\n").encode())
"""

_HUMANEVAL_CHECK = """\
exec(compile({test!r}, "test.py", "exec"), _space)
try:
    _space["check"](_space[{entry!r}])
    _verdict = "passed"
except AssertionError:
    _verdict = "wrong-answer"
"""

_FUNCTION_CHECK = """\
_solution = _space.get("Solution")
_method = getattr(_solution(), {function!r}) if isinstance(_solution, type) else _space[{function!r}]
_arguments = [_json.loads(_line) for _line in {arguments!r}.split("\\n")]
_result = _method(*_arguments)
if isinstance(_result, tuple):
    _result = list(_result)
_verdict = "passed" if _result == _json.loads({expected!r}) else "wrong-answer"
"""


@dataclass(frozen=True)
class CodeGrade:
    """The verdict on one output (see the module docstring)."""

    extracted: str | None  # the program
    correct: bool
    method: str  # "code_block", "completion" or "none"
    from_thinking: bool
    outcome: str
    tests_passed: int
    tests_total: int
    status: str | None = None  # the sandbox status of the test that decided (None: all passed, or no code)
    detail: str | None = None  # why that test did not pass
    runs: int = 0  # sandbox runs the verdict rests on (the tests up to the deciding one)
    seconds: float = 0.0  # their wall time, sandbox set-up included
    isolation: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The record fields of this verdict."""
        return {
            "extracted_answer": self.extracted,
            "correct": self.correct,
            "grading_method": self.method,
            "answer_from_thinking": self.from_thinking,
            "code_outcome": self.outcome,
            "tests_passed": self.tests_passed,
            "tests_total": self.tests_total,
            "test_status": self.status,
            "test_detail": self.detail,
            "sandbox_runs": self.runs,
            "sandbox_seconds": round(self.seconds, 4),
            "sandbox_isolation": list(self.isolation),
        }


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def _function_body(completion: str) -> str:
    """A completion of a function prompt up to the first line that leaves the function."""
    lines = completion.split("\n")
    for number, line in enumerate(lines[1:], start=1):
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:number])
    return completion


def program_for(text: str, problem: Problem) -> tuple[str | None, str, bool]:
    """``(program, method, from_thinking)`` for an output (see the module docstring)."""
    searched = strip_thinking(text)
    code, from_thinking = find_code(searched), False
    if code is None and len(searched) != len(text):
        code = find_code(text)
        from_thinking = code is not None
    entry = problem.extra.get("entry_point")
    if code is not None:
        if entry:  # the prompt's imports and helpers first; the block redefines the function or is its body
            joint = "\n\n" if _defines(code, entry) else ""
            return problem.problem + joint + code, "code_block", from_thinking
        return code, "code_block", from_thinking
    if entry and "```" not in searched and searched.strip():
        return problem.problem + _function_body(searched), "completion", False
    return None, "none", False


def _numbers(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except InvalidOperation:
        return None


def _close(a: Decimal, b: Decimal, tolerance: float) -> bool:
    return abs(a - b) <= Decimal(repr(tolerance)) * max(Decimal(1), abs(b))


def stdio_equal(output: str, expected: str, tolerance: float | None = None) -> bool:
    """LiveCodeBench's comparison of a program's standard output with the expected one (module docstring)."""
    got = [line.strip() for line in output.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        x, y = _numbers(a), _numbers(b)
        if x is None or y is None or len(x) != len(y):
            return False
        if x != y and (tolerance is None or not all(_close(p, q, tolerance) for p, q in zip(x, y, strict=True))):
            return False
    return True


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS // 2] + " ... " + text[-_DETAIL_CHARS // 2 :]


def _failure(result: RunResult) -> tuple[str, str]:
    """``(outcome, detail)`` of a run that did not end well."""
    if result.status == "timeout":
        return "timeout", "ran past its time limit"
    last = [line for line in result.stderr.strip().splitlines() if line.strip()]
    reason = last[-1] if last else f"exit status {result.returncode}"
    if result.status != "failed":
        reason = f"{result.status}: {reason}"
    return "runtime-error", _short(reason)


# A test: the program to run, its standard input, and how to judge what a run that ended well wrote.
Judge = Callable[[str], tuple[str, str | None]]


def _marked(mark: str) -> Judge:
    def judge(stdout: str) -> tuple[str, str | None]:
        last = stdout.rstrip("\n").split("\n")[-1]
        if last == f"{mark} passed":
            return "passed", None
        if last == f"{mark} wrong-answer":
            return "wrong-answer", "a test's check failed"
        return "runtime-error", "the program ended before the tests finished"

    return judge


def _compared(expected: str, tolerance: float | None) -> Judge:
    def judge(stdout: str) -> tuple[str, str | None]:
        if stdio_equal(stdout, expected, tolerance):
            return "passed", None
        return "wrong-answer", _short(f"expected {expected.strip()!r}, got {stdout.strip()!r}")

    return judge


def _harnessed(program: str, check: str, **fields: str) -> tuple[str, str, Judge]:
    mark = secrets.token_hex(12)
    return _HARNESS.format(program=program, check=check.format(**fields), mark=mark), "", _marked(mark)


def tests_for(program: str, problem: Problem) -> list[tuple[str, str, Judge]]:
    """The runs that grade ``program``, in test order."""
    extra = problem.extra
    if extra.get("entry_point"):
        return [_harnessed(program, _HUMANEVAL_CHECK, test=extra["test"], entry=extra["entry_point"])]
    program = (PRELUDE if extra.get("prelude") else "") + program
    if problem.kind == "code-function":
        function = extra["function"]
        return [
            _harnessed(program, _FUNCTION_CHECK, function=function, arguments=t["input"], expected=t["output"])
            for t in extra["tests"]
        ]
    return [(program, t["input"], _compared(t["output"], extra.get("tolerance"))) for t in extra["tests"]]


class CodeGrader:
    """Grades code answers in ``sandbox`` (its missing guarantees checked at once), running up to ``workers``
    tests at once (default: the CPUs this process may use), each with ``timeout`` wall-clock (and CPU) seconds
    and ``memory_mb`` MiB for the run as a whole."""

    def __init__(self, sandbox: Sandbox, *, timeout: float = 6.0, memory_mb: int = 1024, workers: int | None = None):
        if workers is not None:
            check_int("workers", workers, 1)
        self.timeout = check_timeout(timeout)  # here, not in every test run: one clear error, not one per unit
        self.memory_mb = check_memory(memory_mb)
        sandbox.check()
        self.sandbox = sandbox
        self.workers = workers or len(os.sched_getaffinity(0))

    def describe(self) -> dict[str, Any]:
        """The grader's settings and the sandbox's isolation, for a run manifest."""
        settings = {"timeout": self.timeout, "memory_mb": self.memory_mb, "workers": self.workers}
        return {**settings, **self.sandbox.describe()}

    def grade(self, text: str, problem: Problem) -> CodeGrade:
        """Run the program of ``text`` against every test of ``problem`` (module docstring)."""
        return self.grade_all([(text, problem)])[0]

    def grade_all(self, items: Sequence[tuple[str, Problem]]) -> list[CodeGrade]:
        """:meth:`grade` of every ``(text, problem)``, their tests sharing the ``workers``."""
        if not items:
            return []
        with (
            ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox") as runs,
            ThreadPoolExecutor(len(items), thread_name_prefix="grade") as outputs,
        ):
            # Programs are found here, in one thread: Python 3.11's ast.parse is not safe to call from several.
            found = [(program_for(text, problem), problem) for text, problem in items]
            futures = [outputs.submit(self._grade, program, problem, runs) for program, problem in found]
            return [future.result() for future in futures]

    def _grade(self, found: tuple[str | None, str, bool], problem: Problem, runs: ThreadPoolExecutor) -> CodeGrade:
        program, method, from_thinking = found
        tests = tests_for(program or "", problem)
        total = len(tests)
        if program is None:
            return CodeGrade(None, False, method, from_thinking, "no-code", 0, total)
        futures: list[Future] = [
            runs.submit(self.sandbox.run, source, stdin, self.timeout, self.memory_mb) for source, stdin, _ in tests
        ]
        seconds, isolation = 0.0, ()
        try:
            for index, (future, (_, _, judge)) in enumerate(zip(futures, tests, strict=True)):
                result = future.result()
                seconds += result.seconds
                isolation = result.isolation
                outcome, detail = judge(result.stdout) if result.status == "ok" else _failure(result)
                if outcome != "passed":
                    return CodeGrade(
                        program, False, method, from_thinking, outcome, index, total,
                        result.status, detail, index + 1, seconds, isolation,
                    )  # fmt: skip
        finally:
            for future in futures:
                future.cancel()  # the tests after the deciding one that have not started
        return CodeGrade(
            program, True, method, from_thinking, "passed", total, total, None, None, total, seconds, isolation
        )
