"""Paths in results and reports: the package's files by the package, others relative to the run's folder,
the home directory as ~, never the machine's own layout."""

from __future__ import annotations

from pathlib import Path

import pytest

import reasonkv
from reasonkv.runs.paths import command_line, portable_argv, portable_command, portable_path

PACKAGE = Path(reasonkv.__file__).resolve().parent


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home


def test_a_bundled_dataset_is_named_by_the_package(tmp_path, home):
    assert portable_path(PACKAGE / "data" / "gsm8k.jsonl", tmp_path / "runs") == "<reasonkv>/data/gsm8k.jsonl"


def test_other_files_are_relative_to_the_runs_folder(tmp_path, home):
    runs = tmp_path / "work" / "runs" / "a"
    assert portable_path(runs / "problems.jsonl", runs) == "problems.jsonl"
    assert portable_path(tmp_path / "work" / "data" / "p.jsonl", runs) == "../../data/p.jsonl"
    assert portable_path(home / "data" / "p.jsonl", home / "runs") == "../data/p.jsonl"  # no home spelled out


def test_a_file_in_the_home_directory_of_a_run_elsewhere_is_under_tilde(tmp_path, home):
    assert portable_path(home / "data" / "p.jsonl", tmp_path / "work" / "runs") == "~/data/p.jsonl"


def test_a_relative_path_is_the_users_own_spelling_and_kept():
    assert portable_path("docs/results/results.jsonl", "/anywhere") == "docs/results/results.jsonl"


def test_a_command_line_loses_every_absolute_path(tmp_path, home):
    runs = tmp_path / "runs"
    argv = ["reasonkv", "eval", "--dataset", str(runs / "p.jsonl"), f"--out={runs / 'r.jsonl'}", "--budgets", "64"]
    assert portable_argv(argv, runs) == ["reasonkv", "eval", "--dataset", "p.jsonl", "--out=r.jsonl", "--budgets", "64"]
    assert str(tmp_path) not in " ".join(portable_argv([*argv, str(home / "m")], runs))


def test_the_recorded_command_is_reasonkv_and_its_arguments_whatever_started_it(tmp_path, home):
    runs = tmp_path / "runs"
    argv = [str(tmp_path / "venv" / "lib" / "reasonkv" / "__main__.py"), "bench", "--out", str(runs)]
    assert command_line(runs, argv) == ["reasonkv", "bench", "--out", "."]
    spelled = f"reasonkv calibrate --dataset '{runs / 'my data.jsonl'}' --out {runs}"
    assert portable_command(spelled, runs) == "reasonkv calibrate --dataset 'my data.jsonl' --out ."
