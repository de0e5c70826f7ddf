"""Results files: one JSON object per line, appended and flushed record by record, resumable.

A run that is killed leaves at worst one truncated last line. :func:`read_records` skips it and
:func:`ResultsFile` cuts it off before appending, so the next run continues cleanly. A malformed
line anywhere else is an error (the file was edited or two writers collided), never skipped silently.

Every record has a ``kind`` (``"generation"`` or ``"fidelity"``); :func:`record_key` names the unit
of work a record completes, so a rerun skips exactly the work already on disk.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["KEY_FIELDS", "ResultsFile", "read_records", "record_key"]

#: The fields that identify a unit of work, per record kind. Two records with the same key are the
#: same work: a rerun skips it. Everything that changes the result is in the key.
KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "generation": (
        "model",
        "dtype",
        "dataset",
        "problem_id",
        "policy_config",
        "budget",
        "buffer",
        "tier",
        "sample",
        "base_seed",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "prompt_format",
    ),
    "fidelity": (
        "model",
        "dtype",
        "dataset",
        "problem_id",
        "policy_config",
        "budget",
        "buffer",
        "tier",
        "base_seed",
        "fidelity_tokens",
        "prompt_format",
    ),
}


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value (dicts sorted, lists as tuples, floats normalised)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)  # 0.0 and 0 are the same setting once written to JSON
    return value


def record_key(record: Mapping[str, Any]) -> tuple:
    """The unit of work ``record`` completes: ``(kind, *values of KEY_FIELDS[kind])``.

    Missing fields count as ``None``. Raises ``ValueError`` for an unknown ``kind``.
    """
    kind = record.get("kind")
    if kind not in KEY_FIELDS:
        raise ValueError(f"record kind must be one of {sorted(KEY_FIELDS)}, got {kind!r}")
    return (kind, *(_canonical(_jsonable(record.get(name))) for name in KEY_FIELDS[kind]))


def _jsonable(value: Any) -> Any:
    # Keys are compared between records read back from JSON and records about to be written, so
    # both go through the same conversion (tuples become lists, non-JSON values become strings).
    return json.loads(json.dumps(value, default=str))


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of a results file (``[]`` when it does not exist).

    A last line that is not valid JSON (a run killed mid-write) is ignored; an invalid line
    before the last one raises ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            if i == last:
                break  # the tail of an interrupted write
            raise ValueError(f"{path}, line {i + 1}: not a JSON record ({error})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {i + 1}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


class ResultsFile:
    """Append-only JSONL writer that knows which work is already done.

    Opening it reads the existing records (``records``, ``done``) and cuts off an incomplete last
    line. :meth:`append` writes one record, flushes it to the operating system and marks its key
    done, so a process killed at any point afterwards keeps it.

    Parameters
    ----------
    path
        The results file; its directory is created if needed.
    fsync
        Also force each record to disk (survives a machine crash, not only a killed process).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_incomplete_tail()
        self.records = read_records(self.path)
        self.done: set[tuple] = set()
        for record in self.records:
            if record.get("kind") in KEY_FIELDS:
                self.done.add(record_key(record))
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _drop_incomplete_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            json.loads(tail)
        except (json.JSONDecodeError, UnicodeDecodeError):
            with open(self.path, "r+b") as handle:
                handle.truncate(cut)
            return
        with open(self.path, "ab") as handle:  # a complete record that only lacks its newline
            handle.write(b"\n")

    def is_done(self, record: Mapping[str, Any]) -> bool:
        """Whether the work ``record`` describes (only its key fields matter) is already in the file."""
        return record_key(record) in self.done

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record as a line, flush it, and mark its key done."""
        line = json.dumps(record, ensure_ascii=False, default=str, allow_nan=True)
        self._handle.write(line + "\n")
        self._handle.flush()
        if self.fsync:
            os.fsync(self._handle.fileno())
        self.records.append(json.loads(line))
        if record.get("kind") in KEY_FIELDS:
            self.done.add(record_key(record))

    def extend(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.append(record)

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
