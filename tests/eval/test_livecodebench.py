"""LiveCodeBench's release files: rows in its code_generation_lite schema, read as published; the
compressed private tests decoded without ever running what a pickle names; the contest-date window."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

import reasonkv.eval.livecodebench as livecodebench
from reasonkv import sandbox
from reasonkv.eval.code import CodeGrader
from reasonkv.eval.datasets import load_dataset
from reasonkv.eval.plan import plan_grid


def compress(tests: list[dict]) -> str:
    """LiveCodeBench's private-test format: base64 of zlib of a pickle of the JSON string."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode("ascii")


def row(question_id: str, date: str, *, functional: bool, public: list[dict], private: str, **fields) -> dict:
    """A row of a release file (every field of the schema, as strings where the files hold strings)."""
    return {
        "question_title": f"Problem {question_id}",
        "question_content": f"Statement of {question_id}.",
        "platform": "leetcode" if functional else "atcoder",
        "question_id": question_id,
        "contest_id": "weekly-contest-400" if functional else "abc350",
        "contest_date": f"{date}T00:00:00",
        "starter_code": "class Solution:\n    def addUp(self, nums: List[int], k: int) -> int:\n        "
        if functional
        else "",
        "difficulty": "easy",
        "public_test_cases": json.dumps(public),
        "private_test_cases": private,
        "metadata": json.dumps({"func_name": "addUp"} if functional else {}),
        **fields,
    }


STDIO_PUBLIC = [{"input": "3\n1 2 3\n", "output": "6\n", "testtype": "stdin"}]
STDIO_PRIVATE = [
    {"input": "1\n5\n", "output": "5\n", "testtype": "stdin"},
    {"input": "2\n-1 1\n", "output": "0\n", "testtype": "stdin"},
]
FUNCTION_PUBLIC = [{"input": "[1, 2, 3]\n1", "output": "9", "testtype": "functional"}]
FUNCTION_PRIVATE = [{"input": "[]\n5", "output": "0", "testtype": "functional"}]


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def release(tmp_path) -> str:
    return write(
        tmp_path / "test6.jsonl",
        [
            row("abc350_a", "2025-01-15", functional=False, public=STDIO_PUBLIC, private=compress(STDIO_PRIVATE)),
            row("3300", "2025-03-02", functional=True, public=FUNCTION_PUBLIC, private=json.dumps(FUNCTION_PRIVATE)),
            row("abc360_b", "2025-05-20", functional=False, public=STDIO_PUBLIC, private=compress([])),
        ],
    )


def test_a_release_file_is_read_as_published(release):
    stdio, function, later = load_dataset(release)
    assert (stdio.id, stdio.kind, function.id, function.kind) == ("abc350_a", "code-stdio", "3300", "code-function")
    assert stdio.problem == "Statement of abc350_a." and stdio.extra["contest_date"] == "2025-01-15T00:00:00"
    assert stdio.extra["tests"] == [{"input": t["input"], "output": t["output"]} for t in STDIO_PUBLIC + STDIO_PRIVATE]
    assert stdio.extra["public_tests"] == 1 and stdio.extra["prelude"] is True
    assert function.extra["function"] == "addUp" and "class Solution" in function.extra["starter_code"]
    assert len(function.extra["tests"]) == 2 and len(later.extra["tests"]) == 1
    assert stdio.source.startswith("LiveCodeBench atcoder abc350")


def test_the_problems_are_graded_in_the_sandbox(release):
    stdio, function, _ = load_dataset(release)
    allow = () if sandbox.probe().mechanism == "bubblewrap" else tuple(sandbox.GUARANTEES)
    grader = CodeGrader(sandbox.Sandbox(allow_missing=allow), timeout=3.0)
    total = "```python\nn = int(input())\nprint(sum(map(int, input().split())))\n```"
    method = "```python\nclass Solution:\n    def addUp(self, nums, k):\n        return sum(nums) + k * len(nums)\n```"
    graded = grader.grade_all([(total, stdio), (method, function), ("```python\nprint(6)\n```", stdio)])
    assert [g.outcome for g in graded] == ["passed", "passed", "wrong-answer"]
    assert [(g.tests_passed, g.tests_total) for g in graded] == [(3, 3), (2, 2), (1, 3)]


class Exploit:
    """A pickle that runs a command when loaded: exactly what the loader must never do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_malicious_pickle_is_refused_naming_the_problem(tmp_path):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(zlib.compress(pickle.dumps(Exploit(marker)))).decode("ascii")
    path = write(
        tmp_path / "evil.jsonl",
        [row("evil_1", "2025-01-01", functional=False, public=STDIO_PUBLIC, private=payload)],
    )
    with pytest.raises(ValueError, match=r"evil_1.*private_test_cases.*refused a pickle.*(posix|os)\.system"):
        load_dataset(path)
    assert not marker.exists()  # nothing in it ran


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(Path("/etc")),  # a class: any global name is refused
        pickle.dumps({1, 2}),  # plain data, but not the list of tests
        b"not a pickle at all",
    ],
)
def test_other_payloads_are_refused(tmp_path, payload):
    private = base64.b64encode(zlib.compress(payload)).decode("ascii")
    path = write(tmp_path / "bad.jsonl", [row("bad_1", "2025-01-01", functional=False, public=[], private=private)])
    with pytest.raises(ValueError, match="bad_1"):
        load_dataset(path)


def test_compressed_tests_may_not_expand_without_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(livecodebench, "MAX_TESTS_BYTES", 1000)
    big = [{"input": "x" * 5000, "output": "y", "testtype": "stdin"}]
    path = write(
        tmp_path / "big.jsonl", [row("big_1", "2025-01-01", functional=False, public=[], private=compress(big))]
    )
    with pytest.raises(ValueError, match=r"big_1.*more than 1000 bytes"):
        load_dataset(path)


def test_test_types_must_match_the_metadata(tmp_path):
    mixed = row("m_1", "2025-01-01", functional=True, public=STDIO_PUBLIC, private="[]")
    with pytest.raises(ValueError, match="m_1.*test types"):
        load_dataset(write(tmp_path / "m.jsonl", [mixed]))


def test_the_contest_date_window_selects_as_the_leaderboard_does(release):
    def ids(**code):
        plan = plan_grid(dataset=release, policies="full", code=dict(allow_execution=True, **code))
        return [p.id for p in plan.datasets[0][1]]

    assert ids() == ["abc350_a", "3300", "abc360_b"]
    assert ids(after="2025-03-02") == ["3300", "abc360_b"]  # both ends count
    assert ids(after="2025-01-16", before="2025-05-20") == ["3300", "abc360_b"]
    assert ids(before="2025-03-01") == ["abc350_a"]
    plan = plan_grid(dataset=f"{release}:1", policies="full", code=dict(allow_execution=True, after="2025-02-01"))
    assert [p.id for p in plan.datasets[0][1]] == ["3300"]  # the window first, then the limit
    with pytest.raises(ValueError, match="later than"):
        ids(after="2025-06-01", before="2025-01-01")
    with pytest.raises(ValueError, match="--after"):
        ids(after="yesterday")
    with pytest.raises(ValueError, match="humaneval problem 'HumanEval/0' has none"):
        plan_grid(dataset="humaneval", policies="full", code=dict(allow_execution=True, after="2025-01-01"))
