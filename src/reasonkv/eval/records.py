"""Results files: one JSON object per line, a run manifest first, appended and flushed record by record.

Record kinds
    ``manifest`` (what the records after it were computed with; the first line of every results
    file, see :mod:`reasonkv.eval.manifest`), ``generation`` and ``fidelity`` (the results of one unit
    of work each, see :mod:`reasonkv.eval.runner`), and ``error``: a unit that could not be computed,
    with the unit's identity fields, ``unit`` (the kind of record it would have been) and ``error``
    (the reason).

A results file is a :class:`reasonkv.runs.store.JsonlStore` (read back with
:func:`reasonkv.runs.store.iter_records`: a torn last line is skipped, a malformed line anywhere else
is an error). It is this tool's own when its first line is a manifest and every other complete line
is a record of one of these kinds (:func:`scan_results`); nothing else is ever written to (see
:mod:`reasonkv.runs.outputs`).

:func:`unit_key` names the unit of work a record completes (or failed), so a rerun skips exactly the
work already on disk.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from reasonkv.runs.store import JsonlStore, iter_records

__all__ = ["KEY_FIELDS", "KINDS", "ResultsFile", "record_key", "scan_results", "unit_key"]

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

#: Every record kind a results file may hold.
KINDS = ("manifest", "generation", "fidelity", "error")


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

    Missing fields count as ``None``. Raises ``ValueError`` for a kind without a key (manifest, unknown).
    """
    kind = record.get("kind")
    if kind not in KEY_FIELDS:
        raise ValueError(f"record kind must be one of {sorted(KEY_FIELDS)}, got {kind!r}")
    return (kind, *(_canonical(_jsonable(record.get(name))) for name in KEY_FIELDS[kind]))


def unit_key(record: Mapping[str, Any]) -> tuple:
    """The unit a generation, fidelity or error record is about (an error record names it in ``unit``)."""
    if record.get("kind") == "error":
        return record_key({**record, "kind": record.get("unit")})
    return record_key(record)


def _jsonable(value: Any) -> Any:
    # Keys are compared between records read back from JSON and records about to be written, so
    # both go through the same conversion (tuples become lists, non-JSON values become strings).
    return json.loads(json.dumps(value, default=str))


def _not_ours(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is not a reasonkv results file ({why}): nothing was written to it; use another --out")


def scan_results(
    path: str | os.PathLike[str],
    visit: Callable[[dict[str, Any]], None] | None = None,
    *,
    first_only: bool = False,
    include_manifests: bool = False,
) -> list[dict[str, Any]]:
    """Check that ``path`` is this tool's results file and read it; returns its manifests.

    ``visit`` is called with every other record in file order. Raises ``ValueError`` for a file that
    is not a results file (its first record is not a manifest, or a line is not a record of
    :data:`KINDS`), naming the reason; a file written before run manifests existed is named as such.
    A missing file is an empty run (``[]``). ``first_only`` checks the first record only (quick);
    ``include_manifests`` passes the manifests to ``visit`` too.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder: name a results file (e.g. {path / 'results.jsonl'})")
    if not path.exists():
        return []
    if path.stat().st_size == 0:
        raise _not_ours(path, "it is empty")
    manifests: list[dict[str, Any]] = []
    records = iter_records(path)
    number = 0
    while True:
        try:
            record = next(records)
        except StopIteration:
            break
        except ValueError as error:
            raise _not_ours(path, str(error).removeprefix(f"{path}, ")) from None
        number += 1
        kind = record.get("kind")
        if number == 1 and kind in KEY_FIELDS:
            raise ValueError(
                f"{path} holds records written before run manifests existed: reasonkv report reads it, "
                "but a run appends only to a results file that starts with a manifest; use another --out"
            )
        if number == 1 and kind != "manifest":
            raise _not_ours(path, "its first record is not a run manifest")
        if kind not in KINDS:
            raise _not_ours(path, f"record {number} has kind {kind!r}, not one of {', '.join(KINDS)}")
        if kind == "manifest":
            if record.get("tool") != "reasonkv":
                raise _not_ours(path, f"record {number} is a manifest of {record.get('tool')!r}")
            manifests.append(record)
        if visit is not None and (include_manifests or kind != "manifest"):
            visit(record)
        if first_only:
            break
    if not manifests:
        raise _not_ours(path, "it holds no complete record")
    return manifests


def _line(record: Mapping[str, Any]) -> str:
    # Results keep their text readable (not ASCII-escaped) and write NaN as JSON's common extension.
    return json.dumps(dict(record), ensure_ascii=False, default=str)


class ResultsFile:
    """The results file one process appends to: owned, locked, its manifest first.

    Opening it takes the lock (see :mod:`reasonkv.runs.outputs`), checks that an existing file is a
    results file (:func:`scan_results`; ``visit`` sees its records), hands its manifests to ``check``
    (which raises to refuse them), cuts off a torn last line, and writes ``manifest`` (a new file is
    created holding it; an existing one gets it appended unless a manifest with its ``id`` is there).
    :meth:`append` writes one record, flushed to the operating system, so a process killed at any point
    afterwards keeps it.

    Parameters
    ----------
    path
        The results file; its folder is created if needed.
    manifest
        The manifest record of this run (``kind`` ``"manifest"``, with an ``id``).
    visit
        Called with every record already in the file.
    check
        Called with the file's manifests (oldest first) before anything is written.
    lock
        Take the file's lock (default); ``False`` when the caller already holds it.
    fsync
        Also force each record to disk (survives a machine crash, not only a killed process).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest: Mapping[str, Any],
        *,
        visit: Callable[[dict[str, Any]], None] | None = None,
        check: Callable[[list[dict[str, Any]]], None] | None = None,
        lock: bool = True,
        fsync: bool = False,
    ):
        self.path = Path(path)
        if manifest.get("kind") != "manifest" or not manifest.get("id"):
            raise ValueError("a results file starts with a manifest record (kind 'manifest', with an id)")
        scan_results(self.path, first_only=True)  # refuse a foreign file before creating its lock file
        self._store = JsonlStore(self.path, lock="eval" if lock else None, encode=_line, fsync=fsync)
        try:
            manifests = scan_results(self.path, visit)
            if check is not None and manifests:
                check(manifests)
            self.manifests = list(manifests) or [json.loads(json.dumps(dict(manifest), default=str))]
            created = self._store.start(header=manifest)
            if not created and manifest["id"] not in {m.get("id") for m in manifests}:
                self.manifests.append(self._store.append(manifest))
        except BaseException:
            self._store.close()
            raise

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record as a line and flush it."""
        if record.get("kind") not in KINDS:
            raise ValueError(f"record kind must be one of {KINDS}, got {record.get('kind')!r}")
        self._store.append(record)

    def close(self) -> None:
        """Force the records to disk and release the file's lock."""
        self._store.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
