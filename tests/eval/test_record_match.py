"""Records are checked against the manifest of the run that wrote them: a budget outside the grid, another
policy config or another setup is refused (eval and report alike, naming the line and the field), and two
results of one unit whose tokens differ are a conflict, never a duplicate."""

from __future__ import annotations

import json
import re

import pytest

from reasonkv.eval.datasets import dataset_path
from reasonkv.eval.manifest import SETUP_FIELDS, build_manifest, file_sha256
from reasonkv.eval.record_match import manifest_mismatch, run_problems
from reasonkv.eval.records import conflict, outcome, read_results, repair_results, scan_results
from reasonkv.eval.report_rows import read_report_input
from reasonkv.runs.store import read_records

SETUP = {**dict.fromkeys(SETUP_FIELDS), "model": "m", "dtype": "fp32", "prompt_format": "chat", "seed": 0}
SETUP.update(max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0)
CELLS = [
    {"label": "full", "budget": None, "buffer": None, "config": {"policy": "full"}},
    {"label": "streaming", "budget": 32, "buffer": 8, "config": {"policy": "streaming", "sinks": 4}},
    {"label": "streaming", "budget": 64, "buffer": 8, "config": {"policy": "streaming", "sinks": 4}},
]
GRID = {"datasets": [{"name": "gsm8k", "sha256": "ab" * 32}], "policies": CELLS, "fidelity": True}
GRID["fidelity_tokens"] = 128
MANIFEST = build_manifest(setup=SETUP, environment={}, grid=GRID, command=None, world_size=1)


def _gen(problem: str, budget: int | None = 32, **changes) -> dict:
    cell = next(c for c in CELLS if c["budget"] == budget)
    record = {
        "kind": "generation", "model": "m", "dtype": "fp32", "dataset": "gsm8k", "problem_id": problem,
        "policy": cell["label"], "policy_label": cell["label"], "policy_config": cell["config"], "budget": budget,
        "buffer": cell["buffer"], "tier": None, "sample": 0, "base_seed": 0, "max_new_tokens": 64,
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "prompt_format": "chat", "correct": True,
        "extracted_answer": "3", "grading_method": "boxed", "finish_reason": "eos", "output_ids": [5, 6, 7],
        "run": MANIFEST["id"],
    }  # fmt: skip
    return {**record, **changes}


def _write(path, *records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in [MANIFEST, *records]), encoding="utf-8")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"budget": 999}, "field 'budget' is 999, not a budget of streaming in its run {run} (32, 64)"),
        (
            {"policy_config": {"policy": "streaming", "sinks": 8}},
            "field 'policy_config' differs from its run {run}'s streaming@32: option 'sinks' is 8 here, 4 in its run",
        ),
        ({"policy_label": "h2o"}, "field 'policy_label' is \"h2o\", not a policy of its run {run} (full, streaming)"),
        ({"buffer": 16}, "field 'buffer' is 16, but its run {run} has 8"),
        ({"max_new_tokens": 4096}, "field 'max_new_tokens' is 4096, but its run {run} has 64"),
        ({"dataset": "math500"}, "field 'dataset' is \"math500\", not a dataset of its run {run} (gsm8k)"),
        ({"run": "0123456789abcdef"}, "field 'run' is \"0123456789abcdef\", but no manifest before it in this file"),
    ],
)
def test_a_record_that_differs_from_its_runs_manifest_is_named_by_eval_and_report_and_set_aside_by_repair(
    tmp_path, edit, message
):
    path = tmp_path / "r.jsonl"
    _write(path, _gen("a"), {**_gen("b"), **edit}, _gen("c", budget=64))
    said = re.escape(f"{path}, line 3: " + message.format(run=f"run {MANIFEST['id']}").replace("run run", "run"))
    with pytest.raises(ValueError, match=said):
        list(read_results(path))  # what report reads
    with pytest.raises(ValueError, match=said):
        read_report_input(path)
    with pytest.raises(ValueError, match=said + ".*rerun with --repair"):
        scan_results(path)  # what eval resumes from: refused before anything is written
    note = repair_results(path)
    assert note is not None and "(line 3)" in note
    assert [r.get("problem_id") for r in read_records(path)] == [None, "a", "c"]


def test_records_that_agree_with_their_manifest_are_read_and_an_error_record_is_checked_too(tmp_path):
    path = tmp_path / "r.jsonl"
    error = {k: v for k, v in _gen("b", budget=64).items() if k not in ("correct", "output_ids")}
    error.update(kind="error", unit="generation", error="out of memory")
    _write(path, _gen("a"), _gen("a", budget=None), error)
    assert [n for n, _ in read_results(path)] == [1, 2, 3, 4]
    _write(path, {**error, "budget": 128})
    with pytest.raises(ValueError, match="line 2: field 'budget' is 128, not a budget of streaming"):
        list(read_results(path))


def test_two_results_of_one_unit_whose_tokens_differ_conflict(tmp_path):
    # a record of another problem copied and relabelled: it grades alike, but its tokens are another output's
    assert conflict(outcome(_gen("a")), outcome(_gen("a", output_ids=[5, 6, 8]))) == ["output_ids"]
    assert conflict(outcome(_gen("a")), outcome(_gen("a"))) == []
    path = tmp_path / "r.jsonl"
    _write(path, _gen("a"), _gen("b"), _gen("a", output_ids=[9, 9, 9]))
    read = read_report_input(path, drop=("output_ids",))
    assert [c.fields for c in read.conflicts] == [["output_ids"]]
    assert [r["problem_id"] for r in read.records] == ["b"]


def _run_of(datasets: list[dict], code: dict | None = None) -> dict:
    grid = {**GRID, "datasets": datasets, **({} if code is None else {"code": code})}
    return build_manifest(setup=SETUP, environment={}, grid=grid, command=None, world_size=1)


def test_a_record_of_a_problem_the_run_never_had_is_refused_by_eval_and_report(tmp_path):
    # a 2-problem gsm8k run: gsm8k-test-0007 is in the file, but past the run's limit
    gsm8k = {"name": "gsm8k", "file": str(dataset_path("gsm8k")), "sha256": file_sha256(dataset_path("gsm8k"))}
    run = _run_of([{**gsm8k, "limit": 2, "problems": 2, "samples": 1}])
    path = tmp_path / "r.jsonl"
    records = [_gen(p, run=run["id"]) for p in ("gsm8k-test-0000", "gsm8k-test-0001", "gsm8k-test-0007")]
    path.write_text("".join(json.dumps(r) + "\n" for r in [run, *records]), encoding="utf-8")
    said = re.escape(
        f"{path}, line 4: field 'problem_id' is \"gsm8k-test-0007\", not one of the 2 problems of gsm8k in its "
        f"run {run['id']}"
    )
    for read in (lambda: list(read_results(path)), lambda: read_report_input(path), lambda: scan_results(path)):
        with pytest.raises(ValueError, match=said):
            read()
    assert "(line 4)" in repair_results(path)
    assert [n for n, _ in read_results(path)] == [1, 2, 3]
    # without a limit the whole file is the run's
    assert run_problems(_run_of([{**gsm8k, "limit": None}]))["gsm8k"] >= {"gsm8k-test-0007", "gsm8k-test-1318"}


def test_a_runs_problems_are_those_of_its_contest_date_window_and_unknown_once_its_file_changed(tmp_path):
    rows = [{"id": f"p{d}", "problem": "?", "answer": "1", "contest_date": f"2025-01-{d:02d}"} for d in (1, 2, 3, 4)]
    data = tmp_path / "dated.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    entry = {"name": str(data), "file": str(data), "sha256": file_sha256(data), "limit": 1}
    run = _run_of([entry], code={"after": "2025-01-02", "before": "2025-01-03"})
    assert run_problems(run) == {str(data): frozenset({"p2"})}
    record = _gen("p3", dataset=str(data), run=run["id"])
    assert "field 'problem_id' is \"p3\", not one of the 1 problems of" in manifest_mismatch(record, run)
    assert manifest_mismatch(_gen("p2", dataset=str(data), run=run["id"]), run) is None
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]), encoding="utf-8")  # no longer what the run read
    assert run_problems(run) == {} and manifest_mismatch(record, run) is None
