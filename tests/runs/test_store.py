"""The JSONL store (reasonkv.runs.store): resume past a torn line, damaged lines named, one writer, flushed records."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reasonkv.runs.outputs import OutputError, OutputLock, OutputLocked
from reasonkv.runs.store import JsonlStore, compact_line, json_safe, numbered_records, read_records

SRC = Path(__file__).resolve().parents[2] / "src"
HEADER = {"kind": "header", "id": "run-1"}
RECORDS = [{"id": f"r{i}", "value": i / 4, "text": "héllo"} for i in range(3)]


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True, **kwargs)


def test_a_new_file_starts_with_its_header_and_a_resumed_one_does_not_repeat_it(tmp_path):
    path = tmp_path / "deep" / "runs.jsonl"
    with JsonlStore(path, lock="eval") as store:
        assert list(store.records()) == []
        assert store.start(header=HEADER) is True
        assert read_records(path) == [HEADER]
        assert store.append(RECORDS[0]) == json.loads(compact_line(RECORDS[0]))
    with JsonlStore(path, lock="eval") as store:
        assert list(store.records()) == [HEADER, RECORDS[0]]
        assert store.start(header=HEADER) is False  # an existing file keeps its own first line
        store.append(RECORDS[1])
    assert read_records(path) == [HEADER, *RECORDS[:2]]
    assert path.read_text(encoding="utf-8").count("\n") == 3
    with JsonlStore(tmp_path / "plain.jsonl") as store:
        store.start()
        assert not store.path.exists()  # without a header the first record creates the file
        store.append(RECORDS[0])
    assert read_records(tmp_path / "plain.jsonl") == [RECORDS[0]]


@pytest.mark.parametrize("cut", [1, 10, len(compact_line(RECORDS[2])) - 1])
def test_a_resume_skips_the_torn_last_line_then_cuts_it_off(tmp_path, cut):
    path = tmp_path / "runs.jsonl"
    whole = "".join(compact_line(r) + "\n" for r in RECORDS)
    path.write_text(whole[: len(whole) - 1 - len(compact_line(RECORDS[2])) + cut], encoding="utf-8")  # killed mid-write
    store = JsonlStore(path, lock="eval")
    try:
        assert list(store.records()) == RECORDS[:2]
        assert path.read_text(encoding="utf-8").count("\n") == 2  # reading changes nothing
        store.append(RECORDS[2])  # appending starts the store: the torn line goes first
    finally:
        store.close()
    assert path.read_text(encoding="utf-8") == whole
    assert read_records(path) == RECORDS


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(compact_line(RECORDS[0]) + "\n" + compact_line(RECORDS[1]), encoding="utf-8")
    with JsonlStore(path) as store:
        assert list(store.records()) == RECORDS[:2]
        store.append(RECORDS[2])
    assert read_records(path) == RECORDS
    assert path.read_text(encoding="utf-8").endswith("\n") and path.read_text(encoding="utf-8").count("\n") == 3


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("not json\n", "line 2: not a JSON record"),
        ('["a", "list"]\n', "line 2: expected a JSON object, got list"),
        ('{"id": "torn but followed by more\n', "line 2: not a JSON record"),
    ],
)
def test_a_damaged_line_is_an_error_naming_the_file_and_the_line(tmp_path, damage, message):
    path = tmp_path / "runs.jsonl"
    text = compact_line(RECORDS[0]) + "\n" + damage + compact_line(RECORDS[1]) + "\n"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")):
        read_records(path)
    path.write_text(compact_line(RECORDS[0]) + "\n" + damage, encoding="utf-8")  # last, but whole: not a torn write
    with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")):
        read_records(path)
    assert path.read_text(encoding="utf-8") == compact_line(RECORDS[0]) + "\n" + damage


def test_a_binary_junk_line_is_named_as_not_utf8_text(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_bytes(compact_line(RECORDS[0]).encode() + b"\n\x00\xff\x00junk\n")
    with pytest.raises(ValueError) as error:
        read_records(path)
    assert str(error.value) == f"{path}, line 2: not a JSON record (not UTF-8 text: byte 0xff at column 2)"


def test_line_numbers_count_blank_lines(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("\n" + compact_line(RECORDS[0]) + "\n\n" + compact_line(RECORDS[1]) + "\n", encoding="utf-8")
    assert list(numbered_records(path)) == [(2, RECORDS[0]), (4, RECORDS[1])]
    assert list(numbered_records(tmp_path / "missing.jsonl")) == []


_WRITER = """
import sys
from reasonkv.runs.store import JsonlStore
store = JsonlStore(sys.argv[1], lock="eval")
store.append({"id": "first"})
print("appended", flush=True)
sys.stdin.readline()
store.append({"id": "second"})
print("appended", flush=True)
sys.stdin.readline()
store.close()
"""


def test_each_record_is_visible_to_another_reader_at_once_and_a_second_writer_is_refused(tmp_path):
    path = tmp_path / "runs.jsonl"
    writer = _python(_WRITER, str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert writer.stdout.readline().strip() == "appended"
        assert read_records(path) == [{"id": "first"}]  # flushed, though the writer has not closed the file
        refused = re.escape(f"{path} is in use by pid {writer.pid} (reasonkv eval, since ")
        with pytest.raises(OutputLocked, match=refused):
            JsonlStore(path, lock="eval")
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "appended"
        assert read_records(path) == [{"id": "first"}, {"id": "second"}]
    finally:
        writer.send_signal(signal.SIGKILL)  # killed while holding the lock
        writer.wait(timeout=30)
    with JsonlStore(path, lock="eval") as store:  # the kernel dropped the dead writer's lock: resume
        assert [r["id"] for r in store.records()] == ["first", "second"]
        assert json.loads((tmp_path / "runs.jsonl.lock").read_text())["pid"] == os.getpid()
    assert (tmp_path / "runs.jsonl.lock").read_text() == ""  # released; lock files are never deleted
    with pytest.raises(ValueError, match="was closed"):
        store.append({"id": "late"})  # its lock is gone
    (tmp_path / "runs.jsonl.lock").unlink()
    JsonlStore(path).start()
    assert not (tmp_path / "runs.jsonl.lock").exists()  # lock=None: the caller holds the lock that covers it


def test_rewrite_and_discard_replace_the_whole_file(tmp_path):
    path = tmp_path / "runs.jsonl"
    store = JsonlStore(path, fsync=True)
    for record in RECORDS:
        store.append(record)
    store.rewrite([RECORDS[0], RECORDS[2]])
    store.append({"id": "new"})
    assert read_records(path) == [RECORDS[0], RECORDS[2], {"id": "new"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.jsonl"]  # no temporary file left
    store.discard()
    assert not path.exists()
    assert store.append({"id": "again", "pair": (1, math.nan)}) == {"id": "again", "pair": [1, None]}  # as read back
    assert read_records(path) == [{"id": "again", "pair": [1, None]}]


@pytest.mark.parametrize("how", ["file deleted", "folder deleted", "folder renamed", "file replaced"])
def test_a_file_removed_or_moved_while_written_is_an_error_naming_it_never_a_silent_success(tmp_path, how):
    folder = tmp_path / "D"
    path = folder / "runs.jsonl"
    store = JsonlStore(path, lock="eval")
    store.start(HEADER)
    store.append(RECORDS[0])
    if how == "file deleted":
        path.unlink()
    elif how == "folder deleted":
        shutil.rmtree(folder)
    elif how == "folder renamed":
        folder.rename(tmp_path / "D_moved")
    else:  # a new file under the old name (not the one being written)
        (folder / "new").write_text("someone else's file\n")
        os.replace(folder / "new", path)
    with pytest.raises(OutputError, match=re.escape(f"{path} was removed, renamed or replaced while this process")):
        store.append(RECORDS[1])
    with pytest.raises(OutputError, match=re.escape(str(path))) as error:
        store.close()  # the end of a run checks too, and says so rather than report a success
    if how == "folder renamed":
        moved = tmp_path / "D_moved" / "runs.jsonl"
        assert f"(it is now {moved})" in str(error.value) and "move it back and rerun the same command" in str(
            error.value
        )
        assert read_records(moved) == [HEADER, RECORDS[0]]  # nothing written after the move
    elif how == "file replaced":
        assert path.read_text() == "someone else's file\n"  # never written to
    else:
        assert "it was deleted" in str(error.value) and not path.exists()  # never silently re-created


@pytest.mark.parametrize(
    "change", ["another run's file, longer", "one line less", "the first line, same size", "the last line, same size"]
)
def test_a_file_overwritten_in_place_while_written_is_an_error_never_a_silent_success(tmp_path, change):
    # ``cp other.jsonl runs.jsonl`` truncates and rewrites the same file (the inode stays): only its content tells
    path = tmp_path / "runs.jsonl"
    store = JsonlStore(path, lock="eval")
    store.start(HEADER)
    store.append(RECORDS[0])
    store.append(RECORDS[1])
    lines = path.read_bytes().splitlines(keepends=True)
    if change == "another run's file, longer":
        other = [compact_line({"kind": "header", "id": "run-2"}).encode() + b"\n"] + lines[1:] * 3
    elif change == "one line less":
        other = lines[:-1]
    elif change == "the first line, same size":
        other = [lines[0].replace(b"run-1", b"run-2"), *lines[1:]]
    else:
        other = [*lines[:-1], lines[-1].replace(b"r1", b"r9")]
    inode = path.stat().st_ino
    with open(path, "r+b") as handle:  # as cp writes it: truncated, then rewritten
        handle.truncate(0)
        handle.write(b"".join(other))
    assert path.stat().st_ino == inode
    with pytest.raises(OutputError) as error:
        store.append(RECORDS[2])
    assert str(error.value).startswith(f"{path} was overwritten while this process wrote to it (")
    assert "the 2 records written since it started may be gone from it" in str(error.value)
    with pytest.raises(OutputError, match=re.escape(f"{path} was overwritten")):
        store.close()  # the end of a run checks too
    assert path.read_bytes() == b"".join(other)  # nothing written after the change


def test_a_file_replaced_by_mv_is_named_as_replaced_not_deleted(tmp_path):
    path = tmp_path / "runs.jsonl"
    store = JsonlStore(path, lock="eval")
    store.start(HEADER)
    (tmp_path / "other").write_text("someone else's file\n")
    os.rename(tmp_path / "other", path)
    with pytest.raises(OutputError) as error:
        store.append(RECORDS[0])
    assert "(another file took its place; the file written was deleted)" in str(error.value)
    store.close(check=False)


def test_a_lock_file_replaced_by_mv_is_named_as_replaced_not_deleted(tmp_path):
    path = tmp_path / "runs.jsonl"
    lock = OutputLock(path, "eval").acquire()
    try:
        (tmp_path / "other").write_text("")
        os.rename(tmp_path / "other", tmp_path / "runs.jsonl.lock")
        with pytest.raises(OutputError, match=re.escape("another file took the place of the lock")):
            lock.check_in_place()
    finally:
        lock.release()


def test_messages_count_only_the_lines_the_caller_counts_as_records(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    store = JsonlStore(path, counts=lambda record: record.get("kind") != "header")
    store.start(HEADER)
    store.append(RECORDS[0])
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OutputError, match="the 1 complete records in it are safe"):
        store.append(RECORDS[1])
    monkeypatch.undo()
    path.unlink()
    with pytest.raises(OutputError, match="the 1 records written since it started are not at"):
        store.append(RECORDS[1])
    store.close(check=False)


@pytest.mark.parametrize("held", ["by the store", "by the caller"])
def test_a_folder_moved_after_its_lock_was_taken_and_before_the_file_exists_is_never_re_created(tmp_path, held):
    # A process takes its lock, then spends minutes loading a model: the folder moved meanwhile holds the lock,
    # and a file created at the old path would be written where no lock guards it and no resume looks.
    folder, moved = tmp_path / "D", tmp_path / "D_moved"
    path = folder / "runs.jsonl"
    folder.mkdir()
    lock = OutputLock(path, "eval").acquire() if held == "by the caller" else None
    try:
        store = JsonlStore(path, lock=lock or "eval")
        folder.rename(moved)
        refusal = f"{path}: its folder was removed, renamed or replaced while this process held its lock (the lock "
        refusal += f"{folder / 'runs.jsonl.lock'} is now {moved / 'runs.jsonl.lock'})"
        with pytest.raises(OutputError, match=re.escape(refusal) + ".*move the folder back and rerun the same command"):
            store.start(HEADER)
        with pytest.raises(OutputError, match=re.escape(refusal)):
            store.append(RECORDS[0])
        store.close(check=False)
        if lock is not None:
            with pytest.raises(OutputError, match=re.escape(refusal)):
                JsonlStore(path, lock=lock)  # a store opened after the move: refused before it makes a folder
    finally:
        if lock is not None:
            lock.release()
    assert not folder.exists() and sorted(p.name for p in moved.iterdir()) == ["runs.jsonl.lock"]


def test_a_full_disk_leaves_only_whole_records_and_says_what_is_safe_and_how_to_resume(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    store = JsonlStore(path, fsync=True)
    store.start(HEADER)
    store.append(RECORDS[0])
    write = os.write

    def full(fd, data):  # an fd on a full disk: half the line goes in, then ENOSPC
        if fd != store._fd:
            return write(fd, data)
        write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError) as error:
        store.append(RECORDS[1])
    monkeypatch.undo()
    assert str(error.value) == (
        f"{path}: appending a record failed (No space left on device); the 2 complete records in it are safe; "
        "free some space, then rerun the same command: it resumes"
    )
    assert path.read_bytes().endswith(b"\n") and read_records(path) == [HEADER, RECORDS[0]]  # the torn half cut off
    store.append(RECORDS[1])  # space again: the same store goes on
    assert read_records(path) == [HEADER, RECORDS[0], RECORDS[1]]


_KILLED_WHILE_CREATING = """
import os, sys
from reasonkv.runs import outputs
from reasonkv.runs.store import JsonlStore
outputs.os.link = lambda *args: os._exit(9)  # killed after the temporary file is written, before it is linked
JsonlStore(sys.argv[1]).start({"kind": "header"})
"""


def test_a_kill_while_the_file_is_created_leaves_a_temporary_file_the_next_writer_removes(tmp_path):
    path = tmp_path / "runs.jsonl"
    assert _python(_KILLED_WHILE_CREATING, str(path)).wait(timeout=60) == 9
    [stale] = [p.name for p in tmp_path.iterdir()]
    assert stale.startswith(".runs.jsonl.reasonkv-tmp-") and not path.exists()
    (tmp_path / ".runs.jsonl.notes").write_text("a user's file with a similar name\n")
    with JsonlStore(path, lock="eval") as store:
        assert store.start(HEADER)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".runs.jsonl.notes", "runs.jsonl", "runs.jsonl.lock"]
    assert read_records(path) == [HEADER]


def test_records_are_strict_json_by_default_and_the_encoding_is_the_callers():
    record = {
        "nan": math.nan,
        "inf": [1.0, -math.inf],
        "numpy": (np.float32(0.5), np.int64(3), np.float64(math.nan)),
        "flag": True,
        1: None,
        "path": Path("a/b"),
    }
    safe = json_safe(record)
    assert safe == {"nan": None, "inf": [1.0, None], "numpy": [0.5, 3, None], "flag": True, "1": None, "path": "a/b"}
    assert type(safe["numpy"][1]) is int and safe["flag"] is True
    line = compact_line(record)
    assert " " not in line and "NaN" not in line and json.loads(line) == safe


def test_a_store_with_its_own_encoding_reads_back_what_it_wrote(tmp_path):
    path = tmp_path / "runs.jsonl"
    with JsonlStore(path, encode=lambda r: json.dumps(dict(r), ensure_ascii=False)) as store:
        back = store.append({"text": "héllo", "score": math.nan})
    assert path.read_text(encoding="utf-8") == '{"text": "héllo", "score": NaN}\n'
    assert back["text"] == "héllo" and math.isnan(back["score"])


def test_runs_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        "import reasonkv.runs.store, reasonkv.runs.outputs, reasonkv.runs.machine, reasonkv.eval.records; "
        "print(reasonkv.runs.machine.cpu_model())"
    )
    done = _python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert out.strip()
