"""Grading code answers: the program taken from an output, the tests run in the sandbox, the verdict."""

from __future__ import annotations

import dataclasses

import pytest

from reasonkv import sandbox
from reasonkv.eval.code import CodeGrader, program_for, stdio_equal
from reasonkv.eval.datasets import Problem, load_dataset

# Grading logic does not depend on the isolation: where bubblewrap is missing, the plain process runner
# (allowed explicitly here) runs the tests. tests/sandbox/ checks the isolation itself.
SANDBOX = sandbox.Sandbox(allow_missing=() if sandbox.probe().mechanism == "bubblewrap" else tuple(sandbox.GUARANTEES))


@pytest.fixture(scope="module")
def grader() -> CodeGrader:
    return CodeGrader(SANDBOX, timeout=3.0, memory_mb=512)


@pytest.fixture(scope="module")
def humaneval() -> list[Problem]:
    return load_dataset("humaneval")


def fenced(code: str) -> str:
    return f"Let me think.\n```python\n{code.rstrip()}\n```\n"


def stdio_problem(tests, **extra) -> Problem:
    return Problem("s1", "Echo the sum.", "", "test", "code-stdio", extra={"tests": tests, **extra})


def function_problem(tests, function="add", **extra) -> Problem:
    return Problem("f1", "Add.", "", "test", "code-function", extra={"function": function, "tests": tests, **extra})


@pytest.mark.slow
def test_every_canonical_humaneval_solution_passes_and_a_wrong_one_fails(grader, humaneval):
    grades = grader.grade_all([(fenced(p.problem + p.answer), p) for p in humaneval])
    failed = [(p.id, g.outcome, g.detail) for p, g in zip(humaneval, grades, strict=True) if not g.correct]
    assert not failed
    assert all(g.outcome == "passed" and g.tests_passed == g.tests_total == 1 for g in grades)
    wrong = grader.grade_all([(fenced(p.problem + "    return None\n"), p) for p in humaneval[:6]])
    assert {g.outcome for g in wrong} <= {"wrong-answer", "runtime-error"} and not any(g.correct for g in wrong)
    assert sum(g.outcome == "wrong-answer" for g in wrong) >= 4


def test_the_program_of_a_function_prompt(humaneval):
    problem = humaneval[2]  # truncate_number
    whole = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"
    program, method, thinking = program_for(fenced(whole), problem)
    assert program == problem.problem + "\n\n" + whole and method == "code_block" and not thinking
    body = "    return number % 1.0\n"
    assert program_for(fenced(body), problem)[0] == problem.problem + body
    # no fence at all: the completion is the body, cut where it leaves the function
    program, method, _ = program_for(body + "\nprint(truncate_number(3.5))\n", problem)
    assert (program, method) == (problem.problem + body, "completion")
    # a block cut off before its closing fence is no answer
    assert program_for("```python\ndef truncate_number(x):\n    return", problem) == (None, "none", False)
    # the answer after the thinking counts; inside it only when nothing follows it
    program, _, thinking = program_for(f"<think>{fenced(body)}</think>Done.", problem)
    assert program == problem.problem + body and thinking
    other = "    return 0.5\n"
    assert program_for(f"<think>{fenced(body)}</think>{fenced(other)}", problem)[0] == problem.problem + other
    assert program_for("```cpp\nint x;\n```", problem)[0] is None  # another language


def test_standard_output_is_compared_as_livecodebench_does():
    assert stdio_equal("3\n", "3")
    assert stdio_equal("  1 2  \n3\n\n", "1 2\n3")  # white space around lines and blank lines at the end
    assert stdio_equal("1.0 2", "1 2.00")  # numbers as exact decimals
    assert not stdio_equal("1 2", "1\n2")
    assert not stdio_equal("1 2 3", "1 2")
    assert not stdio_equal("0.30000000000000004", "0.3")
    assert stdio_equal("0.30000000000000004", "0.3", tolerance=1e-9)
    assert not stdio_equal("0.31", "0.3", tolerance=1e-3)
    assert stdio_equal("1000000.5", "1000000", tolerance=1e-6)  # relative to the expected value
    assert not stdio_equal("Yes", "yes")


def test_standard_input_tests_run_in_order_and_the_first_failure_decides(grader):
    tests = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    problem = stdio_problem(tests)
    right = grader.grade(fenced("a, b = map(int, input().split())\nprint(a + b)"), problem)
    assert (right.correct, right.outcome, right.tests_passed, right.tests_total, right.runs) == (
        True,
        "passed",
        4,
        4,
        4,
    )
    wrong = grader.grade(fenced("a, b = map(int, input().split())\nprint(a + b if a < 4 else a * b)"), problem)
    assert (wrong.correct, wrong.outcome, wrong.tests_passed, wrong.runs) == (False, "wrong-answer", 2, 3)
    assert "expected '11', got '30'" in wrong.detail and wrong.status == "ok"
    crash = grader.grade(fenced("a, b = map(int, input().split())\nprint(a + b if a != 3 else 1 // 0)"), problem)
    assert (crash.outcome, crash.tests_passed, crash.status) == ("runtime-error", 1, "failed")
    assert "ZeroDivisionError" in crash.detail
    slow = grader.grade(fenced("a, b = map(int, input().split())\nwhile a == 5: pass\nprint(a + b)"), problem)
    assert (slow.outcome, slow.tests_passed, slow.status) == ("timeout", 2, "timeout")
    assert grader.grade("no code here", problem).outcome == "no-code"


def test_function_tests_call_the_function_or_the_solution_method(grader):
    tests = [{"input": "[1, 2]\n3", "output": "[4, 5]"}, {"input": "[]\n1", "output": "[]"}]
    problem = function_problem(tests, function="shift")
    method = "class Solution:\n    def shift(self, xs, k):\n        return tuple(x + k for x in xs)\n"
    assert grader.grade(fenced(method), problem).outcome == "passed"  # a tuple counts as a list
    plain = "def shift(xs, k):\n    return [x + k for x in xs]\n"
    assert grader.grade(fenced(plain), problem).correct
    wrong = grader.grade(fenced("def shift(xs, k):\n    return xs\n"), problem)
    assert (wrong.outcome, wrong.tests_passed) == ("wrong-answer", 0)
    missing = grader.grade(fenced("def other(xs, k):\n    return xs\n"), problem)
    assert missing.outcome == "runtime-error" and "KeyError" in missing.detail


def test_livecodebench_problems_get_its_imports(grader):
    tests = [{"input": "2 10 7\n", "output": "2\n"}]
    program = "a, b, m = map(int, input().split())\nc = defaultdict(int)\nprint(pow(a, b, m))"
    assert grader.grade(fenced(program), stdio_problem(tests, prelude=True)).correct
    assert grader.grade(fenced(program), stdio_problem(tests)).outcome == "runtime-error"  # NameError


@pytest.mark.parametrize(
    "escape",
    [
        "import sys\nsys.exit(0)\n",  # leave before the tests run
        "import os\nos._exit(0)\n",
        "import os\nos.close(1)\n",  # the verdict line cannot be written
        "def check(candidate):\n    pass\n",  # the test's own check replaces this one: still run
    ],
)
def test_a_program_cannot_pass_by_leaving_early(grader, humaneval, escape):
    problem = humaneval[2]
    graded = grader.grade(fenced(escape + "def truncate_number(number):\n    return 0.25\n"), problem)
    assert not graded.correct and graded.outcome in ("runtime-error", "wrong-answer")


@pytest.mark.slow
def test_parallelism_changes_no_result(humaneval):
    tests = [{"input": f"{n}\n", "output": f"{n * n}\n"} for n in range(6)]
    square = stdio_problem(tests)
    items = [
        (fenced("n = int(input())\nprint(n * n)"), square),
        (fenced("n = int(input())\nprint(n * n if n < 3 else n)"), square),
        (fenced("n = int(input())\nprint(1 // (n - 4) and n * n)"), square),
        *[(fenced(p.problem + p.answer), p) for p in humaneval[:4]],
        (fenced(humaneval[5].problem + "    return []\n"), humaneval[5]),
    ]

    def comparable(grade):
        return dataclasses.replace(grade, seconds=0.0)

    one = [comparable(g) for g in CodeGrader(SANDBOX, timeout=3.0, workers=1).grade_all(items)]
    many = [comparable(g) for g in CodeGrader(SANDBOX, timeout=3.0, workers=4).grade_all(items)]
    assert one == many
    assert [g.outcome for g in one[:3]] == ["passed", "wrong-answer", "runtime-error"]
    assert [g.tests_passed for g in one[:3]] == [6, 3, 4]


def test_record_fields_hold_the_program_and_the_verdict(grader, humaneval):
    problem = humaneval[0]
    fields = grader.grade(fenced(problem.problem + problem.answer), problem).fields()
    assert fields["extracted_answer"].startswith(problem.problem) and fields["correct"] is True
    assert fields["code_outcome"] == "passed" and fields["tests_total"] == 1 and fields["sandbox_runs"] == 1
    assert fields["sandbox_seconds"] > 0 and "rlimits" in fields["sandbox_isolation"]
