"""The JSONL store (reasonkv.runs.store): resume past a torn line, damaged lines named, one writer, flushed records."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reasonkv.runs.outputs import OutputLocked
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
    assert not (tmp_path / "runs.jsonl.lock").exists()
    with pytest.raises(ValueError, match="was closed"):
        store.append({"id": "late"})  # its lock is gone
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
