"""Results files: one JSON object per line, a run manifest first, appended and flushed record by record.

Record kinds
    ``manifest`` (what the records after it were computed with; the first line of every results
    file, see :mod:`reasonkv.eval.manifest`), ``generation`` and ``fidelity`` (the results of one unit
    of work each, see :mod:`reasonkv.eval.runner`), and ``error``: a unit that could not be computed,
    with the unit's identity fields, ``unit`` (the kind of record it would have been) and ``error``
    (the reason).

A results file is a :class:`reasonkv.runs.store.JsonlStore`. ``eval`` and ``report`` read it the
same way, with :func:`read_results`: a torn last line is skipped, and any other line that is not a
record of these kinds with fields of the right types (:func:`check_record`) is an error naming the
file, the line and the field. It is this tool's own when its first line is a manifest
(:func:`scan_results`); nothing else is ever written to (see :mod:`reasonkv.runs.outputs`).

:func:`unit_key` names the unit of work a record completes (or failed), so a rerun skips exactly the
work already on disk. Two results of one unit are the same result when :func:`outcome` finds them
equal (what a report counts: the grade, the fidelity figures); otherwise they *conflict*, and neither
command picks one silently (:func:`conflict`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from reasonkv.runs.store import JsonlStore, numbered_records

__all__ = [
    "KEY_FIELDS",
    "KINDS",
    "OUTCOME_FIELDS",
    "ResultsFile",
    "check_record",
    "conflict",
    "outcome",
    "read_results",
    "record_key",
    "scan_results",
    "unit_key",
]

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


# ---------------------------------------------------------------------------------- reading

#: What a result says, per kind: two records of one unit that differ here are a conflict.
OUTCOME_FIELDS: dict[str, tuple[str, ...]] = {
    "generation": ("correct", "extracted_answer", "grading_method", "finish_reason"),
    "fidelity": ("top1_agreement", "kl_mean", "answer_logprob_delta"),
}

_INT = (int,)
_NUMBER = (int, float)
# Field -> (allowed types, what to say); None is allowed for every field below unless it is required.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "dataset": ((str,), "a string"),
    "problem_id": ((str, int), "a string"),
    "policy": ((str,), "a string"),
    "policy_label": ((str,), "a string"),
    "policy_config": ((dict,), "an object"),
    "dtype": ((str,), "a string"),
    "prompt_format": ((str,), "a string"),
    "run": ((str,), "a string"),
    "budget": (_INT, "a positive integer or null"),
    "buffer": (_INT, "a non-negative integer or null"),
    "tier": ((dict,), "an object or null"),
    "sample": (_INT, "a non-negative integer"),
    "base_seed": (_INT, "an integer"),
    "max_new_tokens": (_INT, "a positive integer"),
    "fidelity_tokens": (_INT, "a positive integer"),
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "top_k": (_INT, "an integer"),
    "output_tokens": (_INT, "an integer"),
    "tokens_per_second": (_NUMBER, "a number"),
    "extracted_answer": ((str,), "a string or null"),
    "grading_method": ((str,), "a string"),
    "finish_reason": ((str,), "a string"),
    "collapse": ((dict,), "an object"),
    "collapsed": ((bool,), "true or false"),
    "top1_agreement": (_NUMBER, "a number between 0 and 1"),
    "kl_mean": (_NUMBER, "a number"),
    "answer_logprob_delta": (_NUMBER, "a number"),
    "answer_logprob_delta_mean": (_NUMBER, "a number"),
}
_BOUNDS = {"budget": 1, "buffer": 0, "sample": 0, "max_new_tokens": 1, "fidelity_tokens": 1}


def _bad(where: str, name: str, what: str, value: Any) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ValueError(f"{where}: {name!r} must be {what}, got {shown}")


def check_record(record: Mapping[str, Any], where: str) -> None:
    """Refuse a record that is not one of :data:`KINDS` with fields of the right types.

    ``where`` names the record in the error (``"results.jsonl, line 7"``). A generation record must hold
    ``correct`` as ``true`` or ``false`` (``"yes"`` is not correct), an error record its ``unit`` and
    ``error``; the identity and result fields that a record holds must have their types (``budget`` a
    positive integer or null, ``top1_agreement`` a number between 0 and 1, ...). A manifest is checked by
    :mod:`reasonkv.eval.manifest`.
    """
    kind = record.get("kind")
    if kind not in KINDS:
        what = "no 'kind' field" if "kind" not in record else f"kind {kind!r}"
        raise ValueError(f"{where}: {what}; a results record's kind is one of {', '.join(KINDS)}")
    if kind == "manifest":
        return
    if kind == "generation" and not isinstance(record.get("correct"), bool):
        raise _bad(where, "correct", "true or false", record.get("correct", "nothing"))
    if kind == "error":
        if record.get("unit") not in KEY_FIELDS:
            raise _bad(where, "unit", f"one of {', '.join(KEY_FIELDS)}", record.get("unit", "nothing"))
        if not isinstance(record.get("error"), str):
            raise _bad(where, "error", "the reason, a string", record.get("error", "nothing"))
    for name, (types, what) in _FIELD_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise _bad(where, name, what, value)
        if name in _BOUNDS and value < _BOUNDS[name]:
            raise _bad(where, name, what, value)
        if name == "top1_agreement" and not 0.0 <= value <= 1.0:
            raise _bad(where, name, what, value)


def read_results(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every complete record of a results file, each checked (:func:`check_record`).

    The one reader of results records (``eval`` resuming, ``report``). Nothing when the file does not exist;
    a torn last line is skipped; any other bad line raises ``ValueError`` naming the file and the line.
    """
    for number, record in numbered_records(path):
        check_record(record, f"{path}, line {number}")
        yield number, record


def outcome(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a generation or fidelity record says (:data:`OUTCOME_FIELDS`); ``{}`` for other kinds."""
    return {name: record.get(name) for name in OUTCOME_FIELDS.get(record.get("kind"), ())}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return False
        # Batches of another composition round differently: equal up to float rounding is the same.
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


def conflict(first: Mapping[str, Any], second: Mapping[str, Any]) -> list[str]:
    """The outcome fields in which two results of one unit differ (``[]``: the same result)."""
    return [name for name, value in first.items() if not _same(value, second.get(name))]


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
    records = read_results(path)
    first = True
    while True:
        try:
            number, record = next(records)
        except StopIteration:
            break
        except ValueError as error:
            raise _not_ours(path, str(error).removeprefix(f"{path}, ")) from None
        kind = record.get("kind")
        if first and kind in KEY_FIELDS:
            raise ValueError(
                f"{path} holds records written before run manifests existed: reasonkv report reads it, "
                "but a run appends only to a results file that starts with a manifest; use another --out"
            )
        if first and kind != "manifest":
            raise _not_ours(path, "its first record is not a run manifest")
        first = False
        if kind == "manifest":
            if record.get("tool") != "reasonkv":
                raise _not_ours(path, f"line {number} is a manifest of {record.get('tool')!r}")
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
