"""Code problems in an evaluation grid: the explicit opt-in, the sandbox refused before a model loads when it
lacks a guarantee, the records, the manifest and the report."""

from __future__ import annotations

import argparse
import json

import pytest

import reasonkv.eval.decoding
import reasonkv.eval.runner
from conftest import NoEosTokenizer, tiny_llama
from reasonkv import sandbox
from reasonkv.cli import main
from reasonkv.cli.eval import add_arguments, grid_from
from reasonkv.eval.datasets import load_dataset
from reasonkv.eval.report import write_report
from reasonkv.eval.runner import run_grid
from reasonkv.generation.loop import GenerationResult
from reasonkv.runs.store import read_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PROBLEMS = [
    {
        "id": "sum",
        "kind": "code-stdio",
        "problem": "Read two integers and print their sum.",
        "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
    },
    {
        "id": "double",
        "kind": "code-function",
        "problem": "Return twice x.",
        "function": "double",
        "tests": [{"input": [2], "output": 4}, {"input": [-1], "output": -2}],
    },
    {"id": "math", "problem": "What is 2 + 2?", "answer": "4"},
]
OUTPUTS = {
    "sum": "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "double": "```python\ndef double(x):\n    return x + 2\n```",  # right on the first test only
    "math": "\\boxed{4}",
}
ALLOW = () if sandbox.probe().mechanism == "bubblewrap" else tuple(sandbox.GUARANTEES)


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def settings(dataset: str, tmp_path, **code) -> dict:
    return dict(
        dataset=dataset,
        out=str(tmp_path / "results.jsonl"),
        policies="full,streaming",
        budgets=[16],
        buffer=4,
        max_new_tokens=8,
        progress=False,
        code=code,
    )


def test_code_problems_need_the_explicit_opt_in(dataset, tmp_path, capsys):
    with pytest.raises(ValueError, match="holds code problems.*--allow-code-execution"):
        run_grid(None, None, **settings(dataset, tmp_path))  # refused before any model is loaded
    assert not (tmp_path / "results.jsonl").exists()
    argv = ["eval", "--dataset", "humaneval:1", "--out", str(tmp_path / "r.jsonl"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "humaneval holds code problems" in err and "--allow-code-execution" in err and len(err.splitlines()) == 1


def test_a_sandbox_lacking_a_guarantee_is_refused_before_the_model_loads(dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(reasonkv.eval.runner, "Sandbox", lambda **kw: sandbox.Sandbox(bwrap=None, **kw))
    with pytest.raises(sandbox.SandboxUnavailable, match="cannot guarantee network, process-tree, filesystem"):
        run_grid(None, None, **settings(dataset, tmp_path, allow_execution=True))
    with pytest.raises(sandbox.SandboxUnavailable, match="cannot guarantee process-tree, filesystem"):
        run_grid(None, None, **settings(dataset, tmp_path, allow_execution=True, allow_missing="network"))
    assert not (tmp_path / "results.jsonl").exists()


def test_the_flags_reach_the_grid():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--dataset", "humaneval", "--allow-code-execution", "--code-timeout", "2.5", "--code-memory", "512",
         "--code-workers", "3", "--sandbox-allow-missing", "filesystem", "--sandbox-allow-network",
         "--after", "2025-02-01", "--before", "2025-05-01"]
    )  # fmt: skip
    code = grid_from(args).code
    assert (code.allow_execution, code.timeout, code.memory_mb, code.workers) == (True, 2.5, 512, 3)
    assert code.allow_missing == ("filesystem", "network") and (code.after, code.before) == ("2025-02-01", "2025-05-01")
    default = grid_from(parser.parse_args(["--dataset", "gsm8k"])).code
    assert not default.allow_execution and default.allow_missing == ()
    with pytest.raises(ValueError, match="unknown sandbox guarantee"):
        grid_from(parser.parse_args(["--dataset", "gsm8k", "--sandbox-allow-missing", "everything"]))


def test_records_manifest_and_report_of_a_code_grid(dataset, tmp_path, monkeypatch):
    tokenizer = NoEosTokenizer()
    real_generate = reasonkv.eval.decoding.generate

    def fake_generate(model, tok, prompts, **kwargs):
        results = real_generate(model, tok, prompts, **kwargs)  # real decoding (and eviction), canned text
        texts = [next(OUTPUTS[p["id"]] for p in PROBLEMS if p["problem"][:20] in tok.decode(ids)) for ids in prompts]
        return [
            GenerationResult(text, r.token_ids, r.prompt_tokens, r.finish_reason, r.stats)
            for text, r in zip(texts, results, strict=True)
        ]

    monkeypatch.setattr(reasonkv.eval.decoding, "generate", fake_generate)
    out = tmp_path / "results.jsonl"
    grid = settings(dataset, tmp_path, allow_execution=True, allow_missing=ALLOW)
    result = run_grid(tiny_llama(), tokenizer, fidelity=True, **grid)
    assert result.errors == 0
    records = read_records(out)
    manifest = records[0]
    code = manifest["grid"]["code"]
    assert code["mechanism"] == sandbox.probe().mechanism and code["timeout"] == 6.0
    assert code["isolation"] == list(sandbox.probe().isolation) and code["allowed_missing"] == list(ALLOW)
    generations = {(r["problem_id"], r["policy"]): r for r in records if r["kind"] == "generation"}
    assert len(generations) == 6
    for policy in ("full", "streaming"):
        right, half, math = generations["sum", policy], generations["double", policy], generations["math", policy]
        verdict = (right["correct"], right["code_outcome"], right["tests_passed"], right["tests_total"])
        assert verdict == (True, "passed", 2, 2)
        assert right["extracted_answer"] == "a, b = map(int, input().split())\nprint(a + b)\n"
        assert right["grading_method"] == "code_block" and right["sandbox_runs"] == 2
        assert (half["correct"], half["code_outcome"], half["tests_passed"]) == (False, "wrong-answer", 1)
        assert math["correct"] and "code_outcome" not in math  # math is graded as before
    assert any(r["kind"] == "fidelity" for r in records)  # fidelity replays run unchanged
    report = write_report(out, tmp_path / "report")
    text = report["markdown"].read_text()
    assert "| passed | wrong answer | runtime error | timeout | no code | runs | s/run |" in text
    assert "| full | — | 1 | 1 | 0 | 0 | 0 | 4 |" in text  # sum: 2 runs; double: 2 (the second decides)
    rows = json.loads(report["summary"].read_text())
    full = next(r for r in rows if r["policy"] == "full")
    assert full["code"]["problems"] == {"sum": {"passed": 1}, "double": {"wrong-answer": 1}}
    assert full["pass_at"]["1"] == pytest.approx(2 / 3)  # sum and math solved, double not


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "a", "kind": "code-stdio", "problem": "p"}, "'tests' must be a non-empty list"),
        ({"id": "a", "kind": "code-stdio", "problem": "p", "tests": [{"input": 1, "output": "2"}]}, "must be strings"),
        (
            {"id": "a", "kind": "code-stdio", "problem": "p", "tests": [{"input": "", "output": ""}], "tolerance": -1},
            "'tolerance' must be a non-negative number",
        ),
        ({"id": "a", "kind": "code-function", "problem": "p", "tests": [{"input": [1], "output": 1}]}, "'function'"),
        (
            {"id": "a", "kind": "code-function", "problem": "p", "function": "f", "tests": [{"input": 1, "output": 1}]},
            "list of the function's arguments",
        ),
        ({"id": "a", "kind": "code-function", "problem": "p", "entry_point": "f"}, "field 'test'"),
    ],
)
def test_malformed_code_rows_are_refused_naming_the_line(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as refused:
        load_dataset(str(path))
    assert f"{path}, line 1" in str(refused.value)
