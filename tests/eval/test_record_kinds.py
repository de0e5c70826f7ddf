"""Every committed results file loads through the record classes, and each record reads back as the same line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reasonkv.eval.record_kinds import KINDS, ErrorRecord, GenerationRecord, ManifestRecord, Record, UnitRecord

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _eval_files() -> list[Path]:
    """The committed eval results files (lm-eval's own sample files, and the records of a study's own script such
    as selection's long traces, are not eval records)."""
    files = []
    for path in sorted(RESULTS.rglob("*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            first = json.loads(handle.readline())
        if first.get("kind") in KINDS:
            files.append(path)
    return files


def test_the_committed_results_are_found():
    assert len(_eval_files()) >= 10


@pytest.mark.parametrize("path", _eval_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_committed_record_loads_through_its_kind(path):
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        record = Record.from_json(json.loads(line))
        assert json.dumps(record.to_json(), ensure_ascii=False) == line, f"line {number}"
        if isinstance(record, UnitRecord):
            assert record.key()[0] == record.unit in ("generation", "fidelity")
        else:
            assert isinstance(record, ManifestRecord)


def test_an_error_record_has_the_key_of_the_unit_it_names():
    unit = GenerationRecord({"kind": "generation", "model": "m", "dataset": "d", "problem_id": "p", "sample": 1})
    error = ErrorRecord.of(unit, seed=3, stage="generation", error="ValueError: too long")
    assert error.to_json() == {**unit.to_json(), "kind": "error", "unit": "generation", "seed": 3,
                               "stage": "generation", "error": "ValueError: too long"}  # fmt: skip
    assert list(error.to_json())[0] == "kind" and error.key() == unit.key() and not error.result
    with pytest.raises(ValueError, match="field 'correct' must be true or false"):
        Record.from_json(unit.to_json())
