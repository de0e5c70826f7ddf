"""``reasonkv eval --out``: a file that is not a results file is never written, whatever it holds."""

from __future__ import annotations

import json

import pytest

from reasonkv.cli import main
from reasonkv.eval.datasets import load_dataset

PROBLEMS = [{"id": "p1", "problem": "2+2?", "answer": "4"}, {"id": "p2", "problem": "3+3?", "answer": "6"}]


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return path


def _eval(dataset, out, *extra) -> int:
    # The model is never loaded: every refusal happens before it.
    argv = ["eval", "--model", "no-such-model", "--dataset", str(dataset), "--policies", "full"]
    return main([*argv, "--no-progress", "--out", str(out), *extra])


NOT_OURS = {
    "notes.txt": "my notes\nthe last line matters",
    "pretty.json": json.dumps({"results": [1, 2, 3]}, indent=2),
    "results.jsonl": '{"kind": "generation", "problem_id": "p1", "correct": true}\n',  # from before manifests
    "empty.jsonl": "",
}


@pytest.mark.parametrize("name", sorted(NOT_OURS))
def test_an_existing_file_that_is_not_a_results_file_is_refused_unchanged(dataset, tmp_path, capsys, name):
    out = tmp_path / name
    out.write_text(NOT_OURS[name], encoding="utf-8")
    assert _eval(dataset, out) == 2
    err = capsys.readouterr().err
    assert str(out) in err and ("not a reasonkv results file" in err or "before run manifests" in err)
    assert out.read_text(encoding="utf-8") == NOT_OURS[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["problems.jsonl", name])


def test_the_dataset_is_never_the_output(dataset, tmp_path, capsys):
    before = dataset.read_bytes()
    assert _eval(dataset, dataset) == 2
    assert "an input is never an output" in capsys.readouterr().err
    assert dataset.read_bytes() == before and len(load_dataset(str(dataset))) == 2


def test_a_folder_or_a_foreign_shard_file_is_refused(dataset, tmp_path, capsys):
    folder = tmp_path / "runs"
    folder.mkdir()
    assert _eval(dataset, folder) == 2
    assert "is a folder: name a results file" in capsys.readouterr().err
    shard = tmp_path / "results.shard-0-of-2.jsonl"  # named like a shard of results.jsonl, but not one
    shard.write_text("hand-made\n", encoding="utf-8")
    assert _eval(dataset, tmp_path / "results.jsonl") == 2
    assert f"{shard} is not a reasonkv results file" in capsys.readouterr().err
    assert _eval(dataset, tmp_path / "results.jsonl", "--shard", "1/2") == 2
    assert shard.read_text(encoding="utf-8") == "hand-made\n" and not (tmp_path / "results.jsonl").exists()
