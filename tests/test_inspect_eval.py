"""``eval --trace-problems``: the chosen problems' generations keep their eviction traces beside the results,
each opens as an inspect page, and their records equal those of a run without traces."""

from __future__ import annotations

import json

import pytest

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.cli import main
from reasonkv.eval.runner import run_grid
from reasonkv.inspect.runs import Inspection
from reasonkv.runs.store import read_records

PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2?", "answer": "4"},
    {"id": "alg/p2", "problem": "Half of 10?", "answer": "5"},
    {"id": "p3", "problem": "Say seven.", "answer": "7"},
]
GRID = dict(policies="full,h2o", budgets=[10], buffer=4, max_new_tokens=24, batch_size=3, progress=False)


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def outputs(path) -> dict:
    return {(r["problem_id"], r["policy"]): r["output_ids"] for r in read_records(path) if r["kind"] == "generation"}


def test_traced_problems_keep_their_traces(dataset, tmp_path, one_torch_thread):
    traced, plain = tmp_path / "traced.jsonl", tmp_path / "plain.jsonl"
    run_grid(tiny_llama(), NoEosTokenizer(), dataset=dataset, out=str(traced), trace_problems="alg/p2", **GRID)
    run_grid(tiny_llama(), NoEosTokenizer(), dataset=dataset, out=str(plain), **GRID)
    assert outputs(traced) == outputs(plain)
    files = sorted(p.name for p in (tmp_path / "traced.traces").iterdir())
    assert len(files) == 2 and all(name.startswith("problems.alg_p2.") for name in files), files
    h2o = next(tmp_path / "traced.traces" / name for name in files if "h2o" in name)
    [run] = Inspection.load(h2o).runs
    assert run.token_ids == outputs(traced)[("alg/p2", "h2o")]
    assert len(run.trace.evictions) >= 2
    page = tmp_path / "p2.html"
    assert main(["inspect", "--trace", str(h2o), "--out", str(page)]) == 0
    assert "reasonkv inspect" in page.read_text()


def test_an_unknown_traced_problem_is_refused(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"not in the grid's datasets: \['nope'\]"):
        run_grid(
            tiny_llama(),
            NoEosTokenizer(),
            dataset=dataset,
            out=str(tmp_path / "r.jsonl"),
            trace_problems="p1,nope",
            **GRID,
        )
