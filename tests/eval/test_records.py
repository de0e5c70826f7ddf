"""Results files: manifest first, append and flush, torn last lines, keys, files that are not ours, and
lines edited by hand (named with their field, and moved aside by the repair)."""

from __future__ import annotations

import json
import re

import pytest

from reasonkv.eval.manifest import SETUP_FIELDS, build_manifest
from reasonkv.eval.records import ResultsFile, record_key, repair_results, scan_results, unit_key
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


def _manifest(**environment) -> dict:
    setup = {**dict.fromkeys(SETUP_FIELDS), "model": "m", "dtype": "fp32"}
    grid = {"datasets": [{"name": "d", "sha256": "ab" * 32}], "policies": [{"label": "full", "budget": None}]}
    return build_manifest(setup=setup, environment=environment, grid=grid, command=None, world_size=1)


MANIFEST = _manifest()


def _results_file(path, *records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in [MANIFEST, *records]), encoding="utf-8")


def test_a_new_file_starts_with_the_manifest_and_each_append_is_on_disk_at_once(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    with ResultsFile(path, MANIFEST) as results:
        assert read_records(path) == [MANIFEST]
        results.append({**BASE, "text": "héllo"})
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[1] == json.dumps({**BASE, "text": "héllo"}, ensure_ascii=False)
        assert (tmp_path / "sub" / "r.jsonl.lock").read_text()  # held while the file is open, naming its holder
    assert (tmp_path / "sub" / "r.jsonl.lock").read_text() == ""  # released: the file stays, free
    seen = []
    with ResultsFile(path, MANIFEST, visit=seen.append):  # the same manifest is not written twice
        pass
    assert seen == [{**BASE, "text": "héllo"}] and read_records(path)[0] == MANIFEST and len(read_records(path)) == 2


def test_a_run_with_another_manifest_appends_it_after_the_check(tmp_path):
    path = tmp_path / "r.jsonl"
    _results_file(path, BASE)
    other = _manifest(torch="0.1")
    checked = []
    with ResultsFile(path, other, check=checked.append):
        pass
    assert checked == [[MANIFEST]]
    assert [r.get("id") for r in read_records(path)] == [MANIFEST["id"], None, other["id"]]

    def refuse(manifests):
        raise ValueError("another setup")

    before = path.read_bytes()
    with pytest.raises(ValueError, match="another setup"):
        ResultsFile(path, _manifest(torch="0.2"), check=refuse)
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


EDITED = {
    "not json": ("not json", "line 3: not a JSON record"),
    "odd kind": ('{"kind": "note", "text": "mine"}', "line 3: field 'kind' must be one of manifest, generation"),
    "no kind": (json.dumps({k: v for k, v in BASE.items() if k != "kind"}), "line 3: field 'kind' must be one of"),
    "budget {}": (
        json.dumps({**BASE, "budget": {}}),
        "line 3: field 'budget' must be a positive integer (or null), got {}",
    ),
    "correct yes": (json.dumps({**BASE, "correct": "yes"}), "line 3: field 'correct' must be true or false"),
    "error unit": (json.dumps({**BASE, "kind": "error", "unit": None}), "line 3: field 'unit' must be one of"),
}


@pytest.mark.parametrize("edit", sorted(EDITED))
def test_a_line_edited_by_hand_is_named_with_its_field_and_the_repair_keeps_the_rest(tmp_path, edit):
    line, message = EDITED[edit]
    path = tmp_path / "r.jsonl"
    text = (
        "".join(json.dumps(r) + "\n" for r in [MANIFEST, BASE]) + line + "\n" + json.dumps({**BASE, "sample": 1}) + "\n"
    )
    path.write_text(text, encoding="utf-8")
    for attempt in (lambda: ResultsFile(path, MANIFEST), lambda: scan_results(path)):
        with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")) as error:
            attempt()
        assert "rerun with --repair" in str(error.value)
    assert path.read_text(encoding="utf-8") == text  # nothing written
    done = repair_results(path)
    [aside] = tmp_path.glob("r.jsonl.rejected-*")
    assert done == f"{path}: moved 1 line(s) that were not records (line 3) to {aside}; kept 3"
    assert aside.read_text(encoding="utf-8") == line + "\n"  # as it was, nothing lost
    assert read_records(path) == [MANIFEST, BASE, {**BASE, "sample": 1}]
    assert repair_results(path) is None  # nothing more to move


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("setup", None, "field 'setup' must be an object, got null"),
        ("grid", None, "field 'grid' must be an object, got null"),
        ("environment", "x", "field 'environment' must be an object, got \"x\""),
        ("launch", None, "field 'launch' must be an object"),
        ("command", "reasonkv eval", "field 'command' must be a list of strings"),
        ("created", "edited", None),  # context, not identity: editing it changes nothing
        ("environment", {"torch": "9.9"}, "id [0-9a-f]{16} does not match its content"),
    ],
)
def test_a_hand_edited_manifest_is_named_with_its_field_and_never_set_aside(tmp_path, field, value, message):
    path = tmp_path / "r.jsonl"
    edited = {**MANIFEST, field: value}
    text = "".join(json.dumps(r) + "\n" for r in [edited, BASE])
    path.write_text(text, encoding="utf-8")
    if message is None:
        assert scan_results(path) == [edited]
        return
    for attempt in (lambda: ResultsFile(path, MANIFEST), lambda: scan_results(path), lambda: repair_results(path)):
        with pytest.raises(ValueError, match=f"{path}, line 1: the manifest's {message}") as error:
            attempt()
        assert "restore that line" in str(error.value)
    assert path.read_text(encoding="utf-8") == text
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["r.jsonl"]


def test_a_lock_file_that_is_not_ours_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "r.jsonl"
    lock = tmp_path / "r.jsonl.lock"
    lock.write_text("my own lock notes\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a reasonkv lock file"):
        ResultsFile(path, MANIFEST)
    assert lock.read_text(encoding="utf-8") == "my own lock notes\n"
    assert not path.exists()
