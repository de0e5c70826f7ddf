"""Results files: manifest first, append and flush, torn last lines, keys, and files that are not ours."""

from __future__ import annotations

import json

import pytest

from reasonkv.eval.records import ResultsFile, record_key, scan_results, unit_key
from reasonkv.runs.store import read_records

BASE = {
    "kind": "generation",
    "model": "m",
    "dataset": "d",
    "problem_id": "p",
    "budget": 8,
    "sample": 0,
    "correct": False,
}
MANIFEST = {"kind": "manifest", "tool": "reasonkv", "format": 1, "id": "0123456789abcdef", "setup": {"dtype": "fp32"}}


def _results_file(path, *records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in [MANIFEST, *records]), encoding="utf-8")


def test_a_new_file_starts_with_the_manifest_and_each_append_is_on_disk_at_once(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    with ResultsFile(path, MANIFEST) as results:
        assert read_records(path) == [MANIFEST]
        results.append({**BASE, "text": "héllo"})
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[1] == json.dumps({**BASE, "text": "héllo"}, ensure_ascii=False)
        assert (tmp_path / "sub" / "r.jsonl.lock").is_file()  # held while the file is open
    assert not (tmp_path / "sub" / "r.jsonl.lock").exists()  # removed when done
    seen = []
    with ResultsFile(path, MANIFEST, visit=seen.append):  # the same manifest is not written twice
        pass
    assert seen == [{**BASE, "text": "héllo"}] and read_records(path)[0] == MANIFEST and len(read_records(path)) == 2


def test_a_run_with_another_manifest_appends_it_after_the_check(tmp_path):
    path = tmp_path / "r.jsonl"
    _results_file(path, BASE)
    other = {**MANIFEST, "id": "fedcba9876543210"}
    checked = []
    with ResultsFile(path, other, check=checked.append):
        pass
    assert checked == [[MANIFEST]]
    assert [r.get("id") for r in read_records(path)] == [MANIFEST["id"], None, other["id"]]

    def refuse(manifests):
        raise ValueError("another setup")

    before = path.read_bytes()
    with pytest.raises(ValueError, match="another setup"):
        ResultsFile(path, {**MANIFEST, "id": "1111111111111111"}, check=refuse)
    assert path.read_bytes() == before


def test_torn_last_line_is_skipped_then_cut_off(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(MANIFEST) + "\n" + json.dumps(BASE) + "\n" + '{"kind": "generation", "mod')
    assert read_records(path) == [MANIFEST, BASE]
    with ResultsFile(path, MANIFEST) as results:
        results.append({**BASE, "sample": 1})
    assert read_records(path) == [MANIFEST, BASE, {**BASE, "sample": 1}]
    assert path.read_text(encoding="utf-8").count("\n") == 3


def test_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(MANIFEST) + "\n" + json.dumps(BASE), encoding="utf-8")
    with ResultsFile(path, MANIFEST) as results:
        results.append({**BASE, "sample": 1})
    assert read_records(path) == [MANIFEST, BASE, {**BASE, "sample": 1}]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(BASE) + "\nnot json\n" + json.dumps(BASE) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        read_records(path)
    path.write_text(json.dumps(BASE) + "\nnot json\n", encoding="utf-8")  # a complete line is never a torn write
    with pytest.raises(ValueError, match="line 2"):
        read_records(path)


def test_keys_ignore_json_round_trip_differences():
    a = {**BASE, "temperature": 0, "policy_config": {"policy": "x", "bands": (1, 2)}}
    b = json.loads(json.dumps({**BASE, "temperature": 0.0, "policy_config": {"bands": [1, 2], "policy": "x"}}))
    assert record_key(a) == record_key(b)
    assert record_key(a) != record_key({**a, "temperature": 0.7})
    with pytest.raises(ValueError, match="record kind"):
        record_key({"kind": "other"})


def test_an_error_record_names_the_unit_it_failed():
    error = {**BASE, "kind": "error", "unit": "generation", "error": "ValueError: too long", "stage": "generation"}
    assert unit_key(error) == unit_key(BASE) == record_key(BASE)
    assert unit_key({**error, "sample": 1}) != unit_key(BASE)


FOREIGN = {
    "notes.txt": "my notes\nthe last line matters\n",
    "notes-no-newline.txt": "my notes\nthe last line matters",
    "pretty.json": json.dumps({"a": [1, 2, 3], "b": {"c": 4}}, indent=2),
    "problems.jsonl": '{"id": "p1", "problem": "2+2?", "answer": "4"}\n{"id": "p2", "problem": "3+3?", "answer": "6"}',
    "empty.jsonl": "",
    "other-tool.jsonl": '{"kind": "manifest", "tool": "elsewhere", "id": "x"}\n',
    "odd-kind.jsonl": json.dumps(MANIFEST) + '\n{"kind": "note", "text": "mine"}\n',
    "late-garbage.jsonl": json.dumps(MANIFEST) + "\n" + json.dumps(BASE) + "\nnot json\n" + json.dumps(BASE) + "\n",
    "legacy.jsonl": json.dumps(BASE) + "\n",
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_a_file_that_is_not_a_results_file_is_refused_and_left_unchanged(tmp_path, name):
    path = tmp_path / name
    path.write_text(FOREIGN[name], encoding="utf-8")
    message = "written before run manifests" if name == "legacy.jsonl" else "not a reasonkv results file"
    with pytest.raises(ValueError, match=message):
        ResultsFile(path, MANIFEST)
    assert path.read_text(encoding="utf-8") == FOREIGN[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no lock file, no temporary file left
    with pytest.raises(ValueError, match=message):
        scan_results(path)


def test_a_lock_file_that_is_not_ours_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "r.jsonl"
    lock = tmp_path / "r.jsonl.lock"
    lock.write_text("my own lock notes\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a reasonkv lock file"):
        ResultsFile(path, MANIFEST)
    assert lock.read_text(encoding="utf-8") == "my own lock notes\n"
    assert not path.exists()
