from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reasonkv.eval.datasets import DATASETS, Problem, load_dataset

EXPECTED = {"math500": 500, "gsm8k": 1319, "aime24": 30, "aime25": 30, "hmmt25": 30, "gpqa": 198, "humaneval": 164}
KINDS = {"gpqa": "choice", "humaneval": "code-function"}


def test_names():
    assert set(DATASETS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_datasets_load(name):
    problems = load_dataset(name)
    assert len(problems) == EXPECTED[name]
    assert len({p.id for p in problems}) == len(problems)
    for p in problems:
        assert isinstance(p, Problem)
        assert p.problem.strip() and p.answer.strip() and p.source.strip()
        assert p.kind == KINDS.get(name, "math")
    if name == "gpqa":
        assert {p.answer for p in problems} == set("ABCD")
        assert all(len(p.extra["choices"]) == 4 for p in problems)
    if name == "humaneval":
        assert [p.id for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
        assert all(p.extra["entry_point"] in p.problem and "def check(candidate)" in p.extra["test"] for p in problems)
    if name in ("aime24", "aime25", "gsm8k"):
        assert all(re.fullmatch(r"-?\d+", p.answer) for p in problems)


def test_fields_and_extra():
    [first] = load_dataset("math500", limit=1)
    assert first.id == "test/precalculus/807.json"
    assert first.solution and "\\boxed" in first.solution
    assert first.extra == {"subject": "Precalculus", "level": 2}
    gsm = load_dataset("gsm8k")
    assert {p.extra["answer_raw"] for p in gsm if p.answer == "1450000"} == {"1,450,000"}
    assert load_dataset("aime24")[1].extra["answer_raw"] == "025"
    assert load_dataset("hmmt_feb_2025") == load_dataset("hmmt25")  # alias
    hash(first)  # frozen and hashable despite the extra dict


def test_limit():
    assert [p.id for p in load_dataset("aime25", limit=3)] == ["aime2025-I-1", "aime2025-I-2", "aime2025-I-3"]
    assert load_dataset("gpqa", limit=0) == []
    with pytest.raises(ValueError):
        load_dataset("aime25", limit=-1)


def test_unknown_name_lists_names():
    with pytest.raises(ValueError) as err:
        load_dataset("math5000")
    for name in DATASETS:
        assert name in str(err.value)


def test_missing_path():
    with pytest.raises(FileNotFoundError):
        load_dataset("/nonexistent/problems.jsonl")


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_user_jsonl(tmp_path):
    path = _write(
        tmp_path / "mine.jsonl",
        [
            {"id": "a", "problem": "1+1?", "answer": 2, "topic": "arith"},
            "",
            {"id": "b", "problem": "Pick", "answer": "C", "choices": ["w", "x", "y", "z"], "source": "me"},
            {"id": 3, "problem": "x", "answer": "\\frac12", "kind": "math", "solution": "s"},
        ],
    )
    a, b, c = load_dataset(path)
    assert (a.id, a.answer, a.kind, a.source, a.extra) == ("a", "2", "math", "mine.jsonl", {"topic": "arith"})
    assert (b.kind, b.source, b.extra["choices"][2]) == ("choice", "me", "y")
    assert (c.id, c.solution) == ("3", "s")
    assert len(load_dataset(str(path), limit=1)) == 1


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"id": "a", "problem": "p", "answer": "1"}, {"id": "b", "answer": "1"}],
            "line 2: missing required field 'problem'",
        ),
        ([{"id": "a", "problem": "p", "answer": ""}], "line 1: missing required field 'answer'"),
        ([{"problem": "p", "answer": "1"}], "line 1: missing required field 'id'"),
        (
            [{"id": "a"}],
            "line 1: missing required fields 'problem', 'answer' (a problem needs id, problem (or question)",
        ),
        ([{"question": "q"}], "line 1: missing required fields 'id', 'answer'"),
        (["{not json"], "line 1: invalid JSON"),
        ([{"id": "a", "problem": "p", "answer": "1", "kind": "essay"}], "line 1: field 'kind'"),
        (
            [{"id": "a", "problem": "p", "answer": "1"}, {"id": "a", "problem": "q", "answer": "2"}],
            "duplicate id",
        ),
        ([{"id": "a", "problem": ["p"], "answer": "1"}], "field 'problem' must be a string"),
    ],
)
def test_user_jsonl_errors_name_file_line_field(tmp_path, rows, message):
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_dataset(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_the_common_question_spelling_is_accepted_and_problem_wins_when_both_are_there(tmp_path):
    path = _write(
        tmp_path / "qa.jsonl",
        [
            {"id": "a", "question": "1+1?", "answer": "2"},
            {"id": "b", "question": "raw", "problem": "full", "answer": 1},
        ],
    )
    a, b = load_dataset(path)
    assert (a.problem, a.extra) == ("1+1?", {})
    assert (b.problem, b.extra) == ("full", {"question": "raw"})


def test_a_byte_order_mark_is_accepted_and_a_line_that_is_not_utf8_is_named(tmp_path):
    rows = [{"id": "a", "problem": "1+1?", "answer": "2"}, {"id": "b", "problem": "Zoë's sum?", "answer": "3"}]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # as some editors save UTF-8
    assert [p.problem for p in load_dataset(path)] == ["1+1?", "Zoë's sum?"]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as error:
        load_dataset(latin1)
    column = text.splitlines()[1].index("ë") + 1
    assert (
        str(error.value) == f"{latin1}, line 2: not UTF-8 text (byte 0xeb at column {column}); save the file as UTF-8"
    )


def test_the_readmes_example_of_your_own_problems_loads_as_documented(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    section = readme.split("## Your own problems", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    path = tmp_path / "mine.jsonl"
    path.write_text(example, encoding="utf-8")
    first, second = load_dataset(path)
    assert (first.id, first.problem, first.answer, first.kind) == ("q1", "What is 17 * 23?", "391", "math")
    assert (second.kind, second.answer) == ("choice", "C") and second.problem.startswith("Which is largest?")
