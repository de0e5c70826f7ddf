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
    assert (tmp_path / "out.jsonl.lock").read_text() == ""  # never deleted: released, it is free and empty


def test_waiting_depends_on_the_lock_file_never_on_what_the_holder_wrote_in_it(tmp_path):
    target, steps = tmp_path / "out.jsonl", tmp_path / "out.jsonl.steps.lock"
    child = _hold(target, "merge", steps, 1.0)
    steps.write_text("")  # its record unreadable, as another machine may see it on a network filesystem
    start = time.monotonic()
    with OutputLock(target, "join", path=steps, wait=30):
        assert time.monotonic() - start > 0.3  # waited for the short step to finish
    child.wait(timeout=30)
    child = _hold(target, "merge", tmp_path / "out.jsonl.lock", 30)  # a writer's lock: whatever its purpose,
    try:
        start = time.monotonic()
        with pytest.raises(OutputLocked, match=f"pid {child.pid}"):  # refused at once
            OutputLock(target, "eval").acquire()
        assert time.monotonic() - start < 5
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


_CONTEND = """
import os, sys, time
from reasonkv.runs.outputs import OutputLock, OutputLocked
target, path, wait, go = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.001)
try:
    lock = OutputLock(target, "test", path=path, wait=wait).acquire()
except OutputLocked as error:
    print("refused", error, flush=True)
    sys.exit(0)
start = time.time()
time.sleep(0.3)
print("held", start, time.time(), flush=True)
lock.release()
"""

LOCKS = {  # every lock file the commands take: (target, lock file, seconds a contender waits)
    "a results file's writer": ("r.jsonl", "r.jsonl.lock", 0),
    "a shard file's writer": ("r.shard-1-of-2.jsonl", "r.shard-1-of-2.jsonl.lock", 0),
    "a run's steps (join, merge)": ("r.jsonl", "r.jsonl.steps.lock", 30),
    "a folder's writer (report, bench, calibrate)": ("out", "out/.reasonkv.lock", 0),
}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_two_processes_contending_for_each_lock_never_hold_it_together(tmp_path, lock):
    target, path, wait = LOCKS[lock]
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    for round in range(2):  # both released at the same moment, twice
        go = tmp_path / f"go-{round}"
        args = [str(tmp_path / target), str(tmp_path / path), str(wait), str(go)]
        children = [
            subprocess.Popen([sys.executable, "-c", _CONTEND, *args], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        time.sleep(0.5)  # both started and waiting for the signal
        go.touch()
        outcomes = {child.pid: child.communicate(timeout=60)[0].split() for child in children}
        held = sorted((float(words[1]), float(words[2]), pid) for pid, words in outcomes.items() if words[0] == "held")
        refused = [" ".join(words) for words in outcomes.values() if words[0] == "refused"]
        if wait:  # a short step's lock: the second waits, then holds it after the first
            assert len(held) == 2 and held[0][1] <= held[1][0], outcomes
        else:  # a writer's lock: the second is refused at once, naming the first
            assert len(held) == 1 and len(refused) == 1, outcomes
            assert f"in use by pid {held[0][2]}" in refused[0]


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
