"""What the machine does wrong, not a signal, to a real ``reasonkv eval``: its output removed or moved mid-run,
a full disk, a folder made read-only. Each ends in an error naming the file (never a success for records that
are not where it says), or in a success with a warning when only a clean-up after the work failed; a rerun
resumes with every unit once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tiny_checkpoint import save_tiny_checkpoint

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.manifest import SETUP_FIELDS, build_manifest
from reasonkv.eval.records import unit_key
from reasonkv.eval.runner import run_grid
from reasonkv.eval.shards import shard_files
from reasonkv.runs.store import read_records

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
UNITS = 3 * 2 + 3  # 3 problems x (full, streaming), and streaming's fidelity replays

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "problems.jsonl"
    problems = [{"id": f"p{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    problems[0]["solution"] = "0+0 = \\boxed{0}"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    return path


def _command(tiny_dir: Path, dataset: Path, out: Path, entry: str = "faulty_eval.py") -> list[str]:
    grid = ["--model", str(tiny_dir), "--dataset", str(dataset), "--policies", "full,streaming", "--budgets", "24"]
    grid += ["--buffer", "4", "--max-new-tokens", "10", "--fidelity", "--no-progress", "--out", str(out)]
    return [sys.executable, str(HERE / entry), "eval", *grid]


def _env(**fault: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **fault}


def _eval(tiny_dir: Path, dataset: Path, out: Path, **fault: str) -> subprocess.CompletedProcess:
    command = _command(tiny_dir, dataset, out)
    return subprocess.run(command, env=_env(**fault), capture_output=True, text=True, timeout=600)


def _units(path: Path) -> dict[tuple, dict]:
    records = [r for r in read_records(path) if r["kind"] != "manifest"]
    counts = Counter(unit_key(r) for r in records)
    assert max(counts.values()) == 1, "a unit was recorded twice"
    return {unit_key(r): r for r in records}


def test_an_output_file_removed_mid_run_is_an_error_naming_it_and_never_comes_back_headless(
    tmp_path, tiny_dir, dataset
):
    out = tmp_path / "D" / "r.jsonl"
    done = _eval(tiny_dir, dataset, out, FAULT=f"rm {out}", FAULT_AFTER="3")
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{out} was removed, renamed or replaced while this process wrote to it (it was deleted)" in done.stderr
    assert "already there" not in done.stderr and "accuracy" not in done.stderr  # no summary of lost records
    assert not out.exists()  # not re-created without its manifest by the next record


@pytest.mark.parametrize("how", ["cp", pytest.param("mv", marks=pytest.mark.slow)])
def test_an_output_file_overwritten_or_replaced_mid_run_is_an_error_and_nothing_more_is_written(
    tmp_path, tiny_dir, dataset, how
):
    other = tmp_path / "other" / "r.jsonl"
    other.parent.mkdir()
    setup = {**dict.fromkeys(SETUP_FIELDS), "model": "another", "dtype": "fp32"}
    manifest = build_manifest(setup=setup, environment={}, grid={}, command=None, world_size=1)
    content = (json.dumps(manifest) + "\n").encode()  # another run's results file
    other.write_bytes(content)
    out = tmp_path / "D" / "r.jsonl"
    # cp keeps the file (its inode) and writes another run's manifest and records into it; mv puts another file
    # in its place
    done = _eval(tiny_dir, dataset, out, FAULT=f"{how} {other} {out}", FAULT_AFTER="3")
    assert done.returncode == 2, done.stderr[-2000:]
    if how == "cp":
        assert f"{out} was overwritten while this process wrote to it (its size is " in done.stderr
        assert "the 3 records written since it started may be gone from it" in done.stderr
    else:
        assert f"{out} was removed, renamed or replaced while this process wrote to it (another file took its " in (
            done.stderr
        )
    assert "already there" not in done.stderr and "accuracy" not in done.stderr  # no summary of lost records
    assert out.read_bytes() == content  # nothing written after the change


@pytest.mark.slow
def test_an_output_folder_renamed_mid_run_is_an_error_and_the_run_resumes_once_moved_back(tmp_path, tiny_dir, dataset):
    folder, moved = tmp_path / "D", tmp_path / "D_moved"
    out = folder / "r.jsonl"
    done = _eval(tiny_dir, dataset, out, FAULT=f"mv {folder} {moved}", FAULT_AFTER="3")
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        f"{out} was removed, renamed or replaced" in done.stderr and f"(it is now {moved / 'r.jsonl'})" in done.stderr
    )
    assert "move it back and rerun the same command to resume" in done.stderr and "already there" not in done.stderr
    before = _units(moved / "r.jsonl")
    assert len(before) == 3  # nothing written after the move
    moved.rename(folder)
    resumed = _eval(tiny_dir, dataset, out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "6 generation, 3 fidelity" not in resumed.stderr and "3 already there" in resumed.stderr
    after = _units(out)
    assert len(after) == UNITS and all(after[key] == record for key, record in before.items())


_FULL_DISK = """
set -u
mount -t tmpfs -o size=1m tmpfs "$D"
export FAULT="head -c 4000000 /dev/zero > $D/filler || true" FAULT_AFTER=3  # fill the disk after 3 records
"$@" > "$LOGS/mid-run" 2>&1; echo $? > "$LOGS/mid-run.rc"
unset FAULT FAULT_AFTER
cp "$D/r.jsonl" "$LOGS/mid-run.jsonl"
"$@" > "$LOGS/still-full" 2>&1; echo $? > "$LOGS/still-full.rc"
rm "$D/filler"
"$@" > "$LOGS/freed" 2>&1; echo $? > "$LOGS/freed.rc"
cp "$D/r.jsonl" "$LOGS/freed.jsonl"
ls -A "$D" > "$LOGS/listing"
"""


@pytest.mark.slow
def test_a_full_disk_names_the_file_and_what_is_safe_and_a_rerun_resumes_once_there_is_space(
    tmp_path, tiny_dir, dataset
):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a private mount namespace")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a private mount namespace here: {probe.stderr.decode().strip()}")
    folder, logs = tmp_path / "D", tmp_path / "logs"
    folder.mkdir()
    logs.mkdir()
    out = folder / "r.jsonl"
    env = _env(D=str(folder), LOGS=str(logs))
    command = ["unshare", "-rm", "sh", "-c", _FULL_DISK, "sh", *_command(tiny_dir, dataset, out)]
    subprocess.run(command, env=env, check=True, timeout=1200)

    def log(name: str) -> tuple[int, str]:
        return int((logs / f"{name}.rc").read_text()), (logs / name).read_text()

    rc, text = log("mid-run")
    safe = read_records(logs / "mid-run.jsonl")  # only whole records: a torn line would raise
    assert rc == 2 and (logs / "mid-run.jsonl").read_bytes().endswith(b"\n"), text[-2000:]
    assert (
        f"{out}: appending a record failed (No space left on device); the {len(safe) - 1} complete records in it are "
        "safe; free some space, then rerun the same command: it resumes"
    ) in text
    assert "already there" not in text and len(safe) >= 4  # the manifest and at least the first 3 records
    rc, text = log("still-full")
    assert rc == 2 and re.search(
        rf"--out {out}: its filesystem has [0-9,]+ bytes free: free some space, then rerun", text
    )
    assert "loading" not in text  # refused before the model loads
    rc, text = log("freed")
    assert rc == 0, text[-2000:]
    units = _units(logs / "freed.jsonl")
    assert len(units) == UNITS and all(units[unit_key(r)] == r for r in safe if r["kind"] != "manifest")
    assert sorted((logs / "listing").read_text().split()) == ["r.jsonl", "r.jsonl.lock", "r.jsonl.steps.lock"]


def _read_only(folder: Path):
    """Make ``folder`` read-only (for root too: immutable); returns the undo, or skips where that is impossible."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("root ignores a folder's permissions, and chattr (to make it immutable) is not installed")
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        undo = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        made, undo = True, ["chmod", "755", str(folder)]
    try:
        (folder / "probe").touch()
    except OSError:
        return lambda: subprocess.run(undo, check=True)
    (folder / "probe").unlink()
    if made:
        subprocess.run(undo, check=True)
    pytest.skip("cannot make a folder read-only here (chattr needs a filesystem that supports it)")


def test_a_folder_made_read_only_once_the_work_is_written_costs_a_warning_not_the_run(tmp_path, capsys):
    folder = tmp_path / "D"
    out = folder / "r.jsonl"
    model = tiny_llama()
    grid = dict(dataset=str(_problems(tmp_path)), policies="full,streaming", budgets=[10], buffer=4, fidelity=False,
                max_new_tokens=6, progress=False)  # fmt: skip
    for index in range(2):
        run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 2), **grid)  # merged into r.jsonl
    bigger = {**grid, "budgets": [10, 12]}
    run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **bigger)
    undo, written = [], []

    def last_record(record: dict) -> None:
        written.append(record)
        if len(written) == 1:  # shard 1 of 2 has 1 unit of the new budget: its work is done here
            undo.append(_read_only(folder))

    try:
        result = run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 2), on_record=last_record, **bigger)
        assert result.complete and result.merged is not None  # appended to the existing file
        assert len(shard_files(out)) == 2  # the merged shard files could not be deleted: a warning
        err = capsys.readouterr().err
        assert f"warning: could not delete {shard_files(out)[0][0]}" in err and "its records are in" in err
        again = run_grid(model, NoEosTokenizer(), out=str(out), **bigger)  # a rerun in the read-only folder
        assert again.complete and again.generated == 0
    finally:
        for step in undo:
            step()
    assert len(_units(out)) == 2 * (1 + 2)


def _problems(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    rows = [
        {"id": "p1", "problem": "What is 2+2?", "answer": "4"},
        {"id": "p2", "problem": "Half of 10?", "answer": "5"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
