"""Append-only JSONL files of per-trace records that a killed run resumes from (docs/calibrate.md).

Every record carries its ``id`` and the ``settings`` it was computed with; records with other settings are refused
(``on_mismatch="error"``) or the file is started afresh (``"replace"``). Each file is a
:class:`reasonkv.runs.store.JsonlStore` in the ``calibrate --out`` folder, claimed and locked first
(:func:`claim_output`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reasonkv.runs.outputs import ClaimedFolder, claim_folder
from reasonkv.runs.store import JsonlStore, numbered_records

__all__ = ["OUTPUT_FILES", "RecordStore", "claim_output"]

#: Every file ``reasonkv calibrate`` writes into its folder.
OUTPUT_FILES = ("labels.jsonl", "signals.jsonl", "calibration.json", "correlation.png", "summary.md", "results.json")


def _is_old_calibrate_folder(folder: Path) -> bool:
    """A calibrate folder from before output markers (or its copied stores): a store starts with a trace record."""
    for name in ("labels.jsonl", "signals.jsonl"):
        try:
            with open(folder / name, encoding="utf-8") as handle:
                first = json.loads(handle.readline())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(first, dict) and {"id", "settings"} <= set(first):
            return True
    return False


def claim_output(out: str | os.PathLike, inputs=()) -> ClaimedFolder:
    """Claim and lock the ``calibrate --out`` folder."""
    return claim_folder(out, "calibrate", OUTPUT_FILES, recognise=_is_old_calibrate_folder, inputs=inputs)


class RecordStore:
    """One JSONL file of records keyed by ``id`` (created by the first append), all computed with the same
    JSON-serialisable ``settings``; ``on_mismatch`` (``"error"``, ``"replace"``) says what becomes of a file whose
    records have other settings."""

    def __init__(self, path: str | os.PathLike, settings: Mapping[str, Any], *, on_mismatch: str = "error"):
        if on_mismatch not in ("error", "replace"):
            raise ValueError(f"on_mismatch must be 'error' or 'replace', got {on_mismatch!r}")
        self.path = Path(path)
        self.settings = json.loads(json.dumps(dict(settings)))  # normalised as it will be read back
        self.records: dict[str, dict[str, Any]] = {}
        self._file = JsonlStore(self.path, fsync=True)  # the claimed folder's lock covers it
        self._load(on_mismatch)
        self._file.start()  # cuts off the torn line of an interrupted run

    def _load(self, on_mismatch: str) -> None:
        for number, record in numbered_records(self.path):
            if "id" not in record:
                raise ValueError(f"{self.path}, line {number}: not a record of reasonkv calibrate")
            if record.get("settings") != self.settings:
                if on_mismatch == "replace":
                    self._file.discard()
                    self.records = {}
                    return
                raise ValueError(
                    f"{self.path} holds records computed with other settings "
                    f"({_difference(record.get('settings'), self.settings)}); "
                    "use another output folder or delete the file"
                )
            self.records[str(record["id"])] = record

    def __contains__(self, trace_id: str) -> bool:
        return trace_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write one record (its ``settings`` are set here) and flush it to disk."""
        stored = self._file.append({**record, "settings": self.settings})
        self.records[str(stored["id"])] = stored
        return stored


def _difference(old: Any, new: Mapping[str, Any]) -> str:
    if not isinstance(old, Mapping):
        return "no settings recorded"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys)
