"""``reasonkv eval --out``: a file that is not a results file is never written, whatever it holds; every check
that needs no model (of eval, generate, bench, calibrate, demo) runs before the model loads, naming the argument."""

from __future__ import annotations

import json
import os

import pytest

from reasonkv.cli import main
from reasonkv.eval.datasets import load_dataset
from reasonkv.runs.outputs import OutputLock

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


def _cases(dataset, tmp_path) -> dict[str, tuple[list[str], str]]:
    """Each bad argument: the command line, and what its one-line error must say."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n", encoding="utf-8")
    data, out, bench = ["--dataset", str(dataset)], ["--out", str(tmp_path / "r.jsonl")], ["--out", str(tmp_path / "b")]
    tier, buffer = ["--quantized", "64"], ["--buffer", "-1"]
    negative = "argument --buffer: must be a non-negative integer, got -1"
    return {
        "eval into /proc": (["eval", *data, "--out", "/proc/r.jsonl"], "cannot create the lock file /proc/r.jsonl"),
        "eval under a file": (["eval", *data, "--out", f"{a_file}/r"], f"--out {a_file}/r: {a_file} is a file"),
        "eval locked": (["eval", *data, *out], f"{tmp_path / 'r.jsonl'} is in use by pid {os.getpid()}"),
        "eval full tier": (["eval", *data, "--policies", "full", *tier, *out], "(--quantized 64)"),
        "eval buffer": (["eval", *data, *buffer, *out], negative),
        "generate full tier": (["generate", "--prompt", "hi", "--policy", "full", *tier], "quantized=64"),
        "generate buffer": (["generate", "--prompt", "hi", *buffer], negative),
        "bench into /proc": (["bench", "--out", "/proc/b"], "--out /proc/b: cannot create the folder"),
        "bench under a file": (["bench", "--out", f"{a_file}/b"], f"--out {a_file}/b: {a_file} is a file"),
        "bench full tier": (["bench", "--policies", "full", *tier, *bench], "--quantized"),
        "bench buffer": (["bench", *buffer, *bench], negative),
        "calibrate into /proc": (["calibrate", "--out", "/proc/c"], "--out /proc/c: cannot create the folder"),
        "calibrate under a file": (["calibrate", "--out", f"{a_file}/c"], f"--out {a_file}/c: {a_file} is a file"),
        "calibrate locked": (["calibrate", "--out", str(tmp_path / "c")], f"in use by pid {os.getpid()}"),
        "demo buffer": (["demo", *buffer], negative),
    }


CASES = [
    "eval into /proc", "eval under a file", "eval locked", "eval full tier", "eval buffer", "generate full tier",
    "generate buffer", "bench into /proc", "bench under a file", "bench full tier", "bench buffer",
    "calibrate into /proc", "calibrate under a file", "calibrate locked", "demo buffer",
]  # fmt: skip


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as error:  # refused by the argument parser
        return error.code


@pytest.mark.parametrize("case", CASES)
def test_every_check_that_needs_no_model_runs_before_it_loads_and_names_the_argument(dataset, tmp_path, capsys, case):
    argv, message = _cases(dataset, tmp_path)[case]
    folder = tmp_path / "c"
    folder.mkdir()
    with OutputLock(tmp_path / "r.jsonl", "eval"), OutputLock(folder, "calibrate", path=folder / ".reasonkv.lock"):
        assert _exit_code([*argv, "--model", "no-such-model"]) == 2  # a model that cannot load: never tried
    err = capsys.readouterr().err
    assert message in err and "Cannot load model" not in err and "loading no-such-model" not in err
