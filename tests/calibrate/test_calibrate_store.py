"""``reasonkv calibrate --out``: only its own folder (or copied stores), never its input, one run at a time."""

from __future__ import annotations

import json

import pytest

from reasonkv.cli import main
from reasonkv.runs.outputs import OutputLock


def _calibrate(out, *extra) -> int:
    argv = ["calibrate", "--model", "no-such-model", "--traces", "1", "--no-progress", "--out", str(out), *extra]
    return main(argv)


@pytest.mark.parametrize("name", ["labels.jsonl", "signals.jsonl", "summary.md", "calibration.json"])
def test_a_file_calibrate_did_not_write_is_never_touched(tmp_path, capsys, name):
    out = tmp_path / "anatomy"
    out.mkdir()
    (out / name).write_text("somebody else's\n", encoding="utf-8")
    assert _calibrate(out) == 2
    assert f"{out / name} exists and was not written by `reasonkv calibrate`" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [name]
    assert (out / name).read_text(encoding="utf-8") == "somebody else's\n"


def test_the_dataset_is_never_an_output_and_a_running_calibrate_locks_its_folder(tmp_path, capsys):
    out = tmp_path / "anatomy"
    out.mkdir()
    dataset = out / "labels.jsonl"
    dataset.write_text(json.dumps({"id": "p", "settings": {}}) + "\n", encoding="utf-8")  # looks like our store
    assert _calibrate(out, "--dataset", str(dataset)) == 2
    assert "an input is never an output" in capsys.readouterr().err
    with OutputLock(out, "calibrate", path=out / ".reasonkv.lock"):
        assert _calibrate(tmp_path / "anatomy", "--analyse-only") == 2
        assert f"{out} is in use by pid" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".reasonkv.lock", "labels.jsonl"]  # the lock file stays, free
