"""Results files: one JSON object per line, a run manifest first, appended and flushed record by record.

``eval`` and ``report`` check lines alike: a line that is not a sound record or disagrees with its run's
manifest is an error naming the file, the line and the field, never skipped (:func:`repair_results` moves
such lines aside). Only this tool's results files are ever written to.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from reasonkv.eval.manifest import manifest_problem, shown
from reasonkv.eval.record_kinds import KINDS, UNITS, ErrorRecord, ManifestRecord, Record
from reasonkv.eval.record_match import manifest_mismatch, run_problems
from reasonkv.runs.outputs import OutputLock, create_exclusive, write_atomic
from reasonkv.runs.store import JsonlStore, numbered_lines
from reasonkv.suggest.integers import is_number

__all__ = [
    "ResultsFile",
    "conflict",
    "outcome",
    "checked_lines",
    "read_results",
    "record_key",
    "record_problem",
    "repair_results",
    "scan_results",
    "unit_key",
]


def record_key(record: Mapping[str, Any]) -> tuple:
    """The unit of work a generation or fidelity record completes; ``ValueError`` for any other kind."""
    kind = record.get("kind")
    if kind not in UNITS:
        raise ValueError(f"record kind must be one of {sorted(UNITS)}, got {kind!r}")
    return UNITS[kind](dict(record)).key()


def unit_key(record: Mapping[str, Any]) -> tuple:
    """The unit a generation, fidelity or error record is about (an error record names it in ``unit``)."""
    if record.get("kind") == ErrorRecord.kind:
        return record_key({**record, "kind": record.get("unit")})
    return record_key(record)


def record_problem(record: Mapping[str, Any]) -> str | None:
    """What is wrong with a record read from a results file, in words; None when it is sound."""
    try:
        Record.from_json(record)
    except ValueError as error:
        return str(error)
    return None


def checked_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes, dict[str, Any] | None, str | None]]:
    """:func:`~reasonkv.runs.store.numbered_lines` of a results file, ``problem`` saying what is wrong with a
    line (:func:`record_problem`, or how it differs from its run's manifest), None for a sound record."""
    manifests: dict[str, tuple[dict[str, Any], dict[str, frozenset[str]]]] = {}
    for number, line, record, problem in numbered_lines(path):
        problem = problem or record_problem(record)
        if problem is None and record["kind"] == ManifestRecord.kind:
            if record["id"] not in manifests:
                manifests[record["id"]] = (record, run_problems(record))  # each run's problems read once
        elif problem is None:
            problem = _run_problem(record, manifests)
        yield number, line, record, problem


def _run_problem(
    record: Mapping[str, Any], manifests: Mapping[str, tuple[dict[str, Any], dict[str, frozenset[str]]]]
) -> str | None:
    run = record.get("run")
    if run is None or not manifests:
        return None  # a file written before run manifests existed
    if run not in manifests:
        return f"field 'run' is {shown(run)}, but no manifest before it in this file has that id"
    return manifest_mismatch(record, *manifests[run])


def read_results(path: str | os.PathLike[str]) -> Iterator[tuple[int, Record]]:
    """``(line number, record)`` for every complete record of a results file (none when it does not exist);
    a bad line other than a torn last one raises ``ValueError`` naming the file, the line and the field."""
    for number, _, record, problem in checked_lines(path):
        if problem is not None:
            raise ValueError(f"{path}, line {number}: {problem}")
        yield number, Record.read(record)


def outcome(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a generation or fidelity record says (:meth:`UnitRecord.outcome`); ``{}`` for other kinds."""
    cls = UNITS.get(record.get("kind"))
    return {} if cls is None else cls(dict(record)).outcome()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if not all(is_number(v) for v in (a, b)):
            return False
        # Batches of another composition round differently: equal up to float rounding is the same.
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


def conflict(first: Mapping[str, Any], second: Mapping[str, Any]) -> list[str]:
    """The outcome fields in which two results of one unit differ (``[]``: the same result)."""
    return [name for name, value in first.items() if not _same(value, second.get(name))]


def _not_ours(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is not a reasonkv results file ({why}): nothing was written to it; use another --out")


def _damaged(path: Path, number: int, why: str, repairable: bool) -> ValueError:
    if not repairable:
        return ValueError(
            f"{path}, line {number}: {why}: restore that line as it was written, or move the file away and use "
            "another --out; nothing was written"
        )
    return ValueError(
        f"{path}, line {number}: {why}; nothing was written. Every other line is kept if you rerun with --repair "
        f"(Python: repair=True): lines that are not sound records are moved to {path.name}.rejected-<date>, and the "
        "run resumes from the rest"
    )


def scan_results(
    path: str | os.PathLike[str],
    visit: Callable[[dict[str, Any]], None] | None = None,
    *,
    first_only: bool = False,
    include_manifests: bool = False,
) -> list[dict[str, Any]]:
    """Check that ``path`` is this tool's results file (a missing one is empty) and read it; returns its manifests.
    ``visit`` is called with every other record in file order (the manifests too with ``include_manifests``);
    ``first_only`` checks the first record only."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder: name a results file (e.g. {path / 'results.jsonl'})")
    if not path.exists():
        return []
    if path.stat().st_size == 0:
        raise _not_ours(path, "it is empty")
    manifests: list[dict[str, Any]] = []
    for number, _, record, problem in checked_lines(path):
        manifest = record is not None and record.get("kind") == ManifestRecord.kind
        if not manifests:
            _check_first(path, number, record, problem)
        elif problem is not None:
            raise _damaged(path, number, problem, repairable=not manifest)
        if manifest:
            manifests.append(record)
        if visit is not None and (include_manifests or not manifest):
            visit(record)
        if first_only:
            break
    if not manifests:
        raise _not_ours(path, "it holds no complete record")
    return manifests


def _check_first(path: Path, number: int, record: dict[str, Any] | None, problem: str | None) -> None:
    """Refuse a file whose first record is not a sound manifest of this tool."""
    if record is None:
        raise _not_ours(path, f"line {number}: {problem}")
    kind = record.get("kind")
    if kind in UNITS:
        raise ValueError(
            f"{path} holds records written before run manifests existed: reasonkv report reads it, "
            "but a run appends only to a results file that starts with a manifest; use another --out"
        )
    if kind != ManifestRecord.kind:
        raise _not_ours(path, "its first record is not a run manifest")
    if record.get("tool") != "reasonkv":
        raise _not_ours(path, f"record 1 is a manifest of {record.get('tool')!r}")
    problem = manifest_problem(record)
    if problem is not None:
        raise _damaged(path, number, problem, repairable=False)


def repair_results(path: str | os.PathLike[str]) -> str | None:
    """Move the lines of ``path`` that are not sound records, as they were, to a new ``<name>.rejected-<UTC date>``
    beside it, and replace ``path`` by the rest; what was done in words, None when nothing was wrong. A file
    that is not this tool's, or has an unsound manifest (never set aside), is refused; the caller holds its lock.
    """
    path = Path(path)
    scan_results(path, first_only=True)
    kept: list[bytes] = []
    rejected: list[tuple[int, bytes]] = []
    for number, line, record, problem in checked_lines(path):
        problem = problem if kept else None  # the first line was checked by scan_results
        if problem is None:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
        elif record is not None and record.get("kind") == ManifestRecord.kind:
            raise _damaged(path, number, problem, repairable=False)
        else:
            rejected.append((number, line if line.endswith(b"\n") else line + b"\n"))
    if not rejected:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.rejected-{stamp}")
    create_exclusive(aside, b"".join(line for _, line in rejected))
    write_atomic(path, b"".join(kept).decode("utf-8"))
    lines = ", ".join(str(number) for number, _ in rejected)
    return f"{path}: moved {len(rejected)} line(s) that were not records (line {lines}) to {aside}; kept {len(kept)}"


def _line(record: Mapping[str, Any]) -> str:
    # Results keep their text readable (not ASCII-escaped) and write NaN as JSON's common extension.
    return json.dumps(dict(record), ensure_ascii=False, default=str)


class ResultsFile(JsonlStore):
    """The results file one process appends to (a :class:`~reasonkv.runs.store.JsonlStore`), locked.

    Opening it checks an existing file (``visit`` sees its records, ``check`` its manifests and raises to
    refuse them), cuts off a torn last line and writes ``manifest`` unless a manifest with its ``id`` is
    there. ``lock``: the caller's lock that covers the file (None: the file's own).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest: Mapping[str, Any],
        *,
        visit: Callable[[dict[str, Any]], None] | None = None,
        check: Callable[[list[dict[str, Any]]], None] | None = None,
        lock: OutputLock | None = None,
    ):
        if manifest.get("kind") != ManifestRecord.kind or not manifest.get("id"):
            raise ValueError("a results file starts with a manifest record (kind 'manifest', with an id)")
        scan_results(path, first_only=True)  # refuse a foreign file before creating its lock file
        super().__init__(  # a manifest is no record in messages: it says what the records were computed with
            path, lock=lock or "eval", encode=_line, counts=lambda line: line.get("kind") != ManifestRecord.kind
        )
        try:
            manifests = scan_results(self.path, visit)
            if check is not None and manifests:
                check(manifests)
            self.manifests = list(manifests) or [json.loads(json.dumps(dict(manifest), default=str))]
            created = self.start(header=manifest)
            if not created and manifest["id"] not in {m.get("id") for m in manifests}:
                self.manifests.append(self.append(manifest))
        except BaseException:
            self.close(check=False)
            raise

    def append(self, record: Record | Mapping[str, Any]) -> dict[str, Any]:
        """Write one record as a line and flush it; returns the record as it reads back."""
        if isinstance(record, Record):
            record = record.to_json()
        if record.get("kind") not in KINDS:
            raise ValueError(f"record kind must be one of {tuple(KINDS)}, got {record.get('kind')!r}")
        return super().append(record)
