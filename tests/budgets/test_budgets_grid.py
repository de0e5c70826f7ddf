"""The eval grid under allocations: a cell per evicting policy and allocation, labelled, run, recorded."""

from __future__ import annotations

import json

import pytest

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.grid import make_cells
from reasonkv.eval.runner import run_grid
from reasonkv.runs.store import read_records

PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2? " * 6, "answer": "4", "solution": "2+2 = <<2+2=4>>4.\n#### 4"},
    {"id": "p2", "problem": "Half of 10? " * 6, "answer": "5", "solution": "Half of ten is \\boxed{5}."},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cells_per_allocation_are_labelled_and_checked(tmp_path):
    cells = make_cells(["full", "h2o", "quest"], [64], 4, allocations="uniform,pyramid,adaptive")
    assert [c.label for c in cells] == ["full", "h2o", "h2o~pyramid", "h2o~adaptive", "quest"]
    assert [c.allocation for c in cells] == ["uniform", "uniform", "pyramid", "adaptive", "uniform"]
    with pytest.raises(ValueError, match="needs a budget file"):
        make_cells(["h2o"], [16], 4, allocations="calibrated")
    with pytest.raises(ValueError, match="must be one of uniform, pyramid, adaptive, calibrated, got 'even'"):
        make_cells(["h2o"], [16], 4, allocations="even")
    with pytest.raises(ValueError, match="budgets_file='b.json' .--budgets-file. does not apply to allocation 'pyr"):
        make_cells(["h2o"], [16], 4, allocations="pyramid", budgets_file="b.json")
    with pytest.raises(ValueError, match="budgets_file='b.json' .--budgets-file. does not apply to allocation 'uni"):
        make_cells(["full"], [], 4, allocations="uniform", budgets_file="b.json")  # the full cache's cell too
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"layers": 3, "kv_heads": 2, "weights": [[1, 2], [3, 4], [5, 6]]}))
    [cell] = make_cells(["h2o"], [16], 4, allocations="calibrated", budgets_file=str(path))
    assert cell.label == "h2o~calibrated" and cell.spec.budgets_file == str(path)


def test_a_grid_runs_each_allocation_and_records_it_by_label(tmp_path):
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    out = tmp_path / "results.jsonl"
    model = tiny_llama()
    settings = dict(
        dataset=str(dataset),
        out=str(out),
        policies="full,snapkv",
        options=["snapkv.window=4"],
        budgets=[12],
        buffer=4,
        max_new_tokens=24,
        batch_size=2,
        progress=False,
        fidelity=True,
    )
    uniform = run_grid(model, NoEosTokenizer(), **settings)
    assert uniform.generated == 4
    # The allocated cells are units of their own: added beside the uniform ones, which are not rerun.
    summary = run_grid(model, NoEosTokenizer(), **settings, allocations="uniform,adaptive")
    assert summary.generated == 2 and summary.fidelity == 2
    again = run_grid(model, NoEosTokenizer(), **settings, allocations="uniform,adaptive")
    assert again.generated == 0 and again.fidelity == 0
    records = [r for r in read_records(out) if r["kind"] != "manifest"]
    labels = {r["policy_label"] for r in records}
    assert labels == {"full", "snapkv[window=4]", "snapkv[window=4]~adaptive"}
    adaptive = [r for r in records if r["policy_label"].endswith("~adaptive")]
    assert {r["kind"] for r in adaptive} == {"generation", "fidelity"} and len(adaptive) == 4
    assert {r.get("allocation") for r in adaptive} == {"adaptive"}
    assert all("allocation" not in r for r in records if r not in adaptive)  # uniform: as before
    manifests = [r for r in read_records(out) if r["kind"] == "manifest"]
    assert "snapkv[window=4]~adaptive" in json.dumps(manifests[-1])
