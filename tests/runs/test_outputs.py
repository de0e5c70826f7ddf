"""Output ownership and locks (reasonkv.runs.outputs): refuse what is not ours, one writer, stale locks harmless."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reasonkv.runs.outputs import MARKER, OutputLock, OutputLocked, claim_folder

SRC = Path(__file__).resolve().parents[2] / "src"

_HOLD = """
import sys, time
from reasonkv.runs.outputs import OutputLock
lock = OutputLock(sys.argv[1], sys.argv[2], path=sys.argv[3]).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[4]))
lock.release()
"""


def _hold(target: Path, purpose: str, path: Path, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    args = [sys.executable, "-c", _HOLD, str(target), purpose, str(path), str(seconds)]
    child = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_lock_names_its_holder_a_killed_holder_leaves_no_obstacle(tmp_path):
    target = tmp_path / "out.jsonl"
    child = _hold(target, "eval", tmp_path / "out.jsonl.lock", 60)
    try:
        holder = OutputLock.holder(tmp_path / "out.jsonl.lock")
        assert holder["pid"] == child.pid and holder["purpose"] == "eval"
        with pytest.raises(OutputLocked, match=rf"in use by pid {child.pid} \(reasonkv eval, since "):
            OutputLock(target, "eval").acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert OutputLock.holder(tmp_path / "out.jsonl.lock") is None  # the kernel dropped the dead process's lock
    with OutputLock(target, "eval") as lock:
        assert lock.held and json.loads((tmp_path / "out.jsonl.lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_a_short_lived_holder_is_waited_for_others_are_not(tmp_path):
    target = tmp_path / "out.jsonl"
    child = _hold(target, "merge", tmp_path / "out.jsonl.lock", 1.0)
    start = time.monotonic()
    with OutputLock(target, "eval"):
        assert time.monotonic() - start > 0.3  # waited for the merge to finish
    child.wait(timeout=30)
    child = _hold(target, "merge", tmp_path / "out.jsonl.lock", 30)
    try:
        with pytest.raises(OutputLocked):
            OutputLock(target, "merge", wait_for=(), timeout=0).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


NAMES = ["results.jsonl", "table.md"]


def _ours(folder: Path) -> bool:
    return (folder / "results.jsonl").read_text(encoding="utf-8").startswith('{"mine"')


def test_a_folder_is_claimed_marked_and_locked(tmp_path):
    folder = tmp_path / "new" / "run"
    with claim_folder(folder, "bench", NAMES):
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        assert marker == {"tool": "reasonkv", "command": "bench", "files": sorted(NAMES)}
        with pytest.raises(OutputLocked, match=f"{folder} is in use by pid {os.getpid()}"):
            claim_folder(folder, "bench", NAMES)
    with claim_folder(folder, "bench", [*NAMES, "plot.png"]):  # its own folder: claimed again
        pass
    assert json.loads((folder / MARKER).read_text(encoding="utf-8"))["files"] == sorted([*NAMES, "plot.png"])
    with pytest.raises(ValueError, match="holds the output of `reasonkv bench`, not of `reasonkv calibrate`"):
        claim_folder(folder, "calibrate", NAMES)


def test_files_the_command_did_not_write_are_never_claimed(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me", encoding="utf-8")
    with claim_folder(folder, "bench", NAMES):  # unrelated files may share the folder
        pass
    (folder / "table.md").unlink(missing_ok=True)
    (folder / "extra.md").write_text("mine, not the tool's", encoding="utf-8")
    with pytest.raises(ValueError, match="extra.md exists and was not written by `reasonkv bench`"):
        claim_folder(folder, "bench", [*NAMES, "extra.md"])
    assert (folder / "extra.md").read_text(encoding="utf-8") == "mine, not the tool's"

    other = tmp_path / "other"
    other.mkdir()
    (other / "results.jsonl").write_text("somebody else's\n", encoding="utf-8")
    with pytest.raises(ValueError, match="results.jsonl exists and was not written"):
        claim_folder(other, "bench", NAMES, recognise=_ours)
    assert sorted(p.name for p in other.iterdir()) == ["results.jsonl"]  # no marker, no lock left behind

    old = tmp_path / "old"  # the command's own output from before markers: adopted
    old.mkdir()
    (old / "results.jsonl").write_text('{"mine": 1}\n', encoding="utf-8")
    with claim_folder(old, "bench", NAMES, recognise=_ours):
        pass
    assert json.loads((old / MARKER).read_text(encoding="utf-8"))["files"] == sorted(NAMES)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MARKER).write_text("not json", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a reasonkv marker file"):
        claim_folder(broken, "bench", NAMES)
    assert (broken / MARKER).read_text(encoding="utf-8") == "not json"

    a_file = tmp_path / "a-file"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        claim_folder(a_file, "bench", NAMES)
    with pytest.raises(ValueError, match="an input is never an output"):
        claim_folder(old, "bench", NAMES, inputs=[old / "results.jsonl"])
