"""Results files: append, flush, read back, torn last lines, keys."""

from __future__ import annotations

import json

import pytest

from reasonkv.eval.records import ResultsFile, read_records, record_key

BASE = {"kind": "generation", "model": "m", "dataset": "d", "problem_id": "p", "budget": 8, "sample": 0}


def test_append_is_on_disk_at_once_and_marks_the_work_done(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    with ResultsFile(path) as results:
        assert not results.is_done(BASE)
        results.append({**BASE, "text": "héllo"})
        assert path.read_text(encoding="utf-8") == json.dumps({**BASE, "text": "héllo"}, ensure_ascii=False) + "\n"
        assert results.is_done({**BASE, "text": "other fields do not matter"})
        assert not results.is_done({**BASE, "sample": 1})
    assert ResultsFile(path).is_done(BASE)


def test_torn_last_line_is_skipped_then_cut_off(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(BASE) + "\n" + '{"kind": "generation", "mod', encoding="utf-8")
    assert read_records(path) == [BASE]
    with ResultsFile(path) as results:
        results.append({**BASE, "sample": 1})
    assert read_records(path) == [BASE, {**BASE, "sample": 1}]
    assert path.read_text(encoding="utf-8").count("\n") == 2


def test_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(BASE), encoding="utf-8")
    with ResultsFile(path) as results:
        assert results.is_done(BASE)
        results.append({**BASE, "sample": 1})
    assert len(read_records(path)) == 2


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(BASE) + "\nnot json\n" + json.dumps(BASE) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        read_records(path)


def test_keys_ignore_json_round_trip_differences():
    a = {**BASE, "temperature": 0, "policy_config": {"policy": "x", "bands": (1, 2)}}
    b = json.loads(json.dumps({**BASE, "temperature": 0.0, "policy_config": {"bands": [1, 2], "policy": "x"}}))
    assert record_key(a) == record_key(b)
    assert record_key(a) != record_key({**a, "temperature": 0.7})
    with pytest.raises(ValueError, match="record kind"):
        record_key({"kind": "other"})
