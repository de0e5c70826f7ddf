"""Benchmark problems: the bundled test sets and user-supplied JSONL files.

The bundled files live in ``reasonkv/data/`` (see the README there for sources and licences).
GPQA-Diamond ships inside a password-protected zip, as its authors ask, and is only ever
decompressed in memory.

A user's file is UTF-8 (a byte-order mark is accepted), one JSON object per line, with ``id``,
``problem`` (or ``question``) and ``answer``; optional ``kind``, ``source``, ``solution``, anything
else kept in :attr:`Problem.extra`. An error names the file, the line and every missing field.
"""

from __future__ import annotations

import gzip
import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from reasonkv.eval.codetasks import code_fields
from reasonkv.eval.livecodebench import in_window, parse_day
from reasonkv.suggest import did_you_mean
from reasonkv.suggest.integers import is_int

__all__ = ["DATASETS", "DATA_DIR", "Problem", "dataset_path", "grid_problems", "load_dataset"]

Kind = Literal["math", "choice", "code-function", "code-stdio"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

#: Bundled benchmark name -> file name in ``reasonkv/data/``.
DATASETS: dict[str, str] = {
    "math500": "math500.jsonl",
    "gsm8k": "gsm8k.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "hmmt25": "hmmt_feb_2025.jsonl",
    "gpqa": "gpqa_diamond.jsonl.zip",
    "humaneval": "HumanEval.jsonl.gz",
}

# Other spellings accepted by load_dataset (the file stems).
_ALIASES = {"hmmt_feb_2025": "hmmt25", "gpqa_diamond": "gpqa"}
_NAMES = [*DATASETS, *_ALIASES]

# The password the GPQA authors publish for their own archive; it keeps the questions out of
# plain-text crawls, it is not a secret.
_GPQA_MEMBER = "gpqa_diamond.jsonl"
_GPQA_PASSWORD = b"deserted-untie-orchid"

_REQUIRED = ("id", "problem", "answer")
_SPELLINGS = {"problem": "question"}  # another common name of a required field, used when the field is absent
_KNOWN = {"id", "problem", "answer", "source", "kind", "solution"}
_FORMAT = "a problem needs id, problem (or question) and answer; see the README, 'Your own problems'"
_KINDS = ("math", "choice")


@dataclass(frozen=True)
class Problem:
    """One benchmark problem."""

    id: str  # unique within its dataset
    problem: str  # the question text (LaTeX as in the source; GPQA rows include the lettered options)
    answer: str  # the reference: an integer string, a LaTeX expression, or a letter A-D for "choice"
    source: str  # benchmark and provenance
    kind: Kind = "math"  # how the answer is graded
    solution: str | None = None  # the reference solution, where the source has one
    # Every other field of the row (``level``, ``choices``, ...); out of eq/hash, so a Problem stays hashable.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def dataset_path(name: str) -> Path:
    """Return the bundled file for a dataset name (or alias)."""
    key = _ALIASES.get(name, name)
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; {did_you_mean(name, _NAMES)}known names: {', '.join(DATASETS)}")
    return DATA_DIR / DATASETS[key]


def load_dataset(name_or_path: str | os.PathLike[str], limit: int | None = None) -> list[Problem]:
    """The problems of a bundled benchmark (one of :data:`DATASETS`) or of a JSONL file (see the module docstring;
    a row's ``kind`` defaults to ``"choice"`` when it has ``choices``), the first ``limit`` in file order.

    Raises ``ValueError`` for an unknown name or a malformed row (naming the file, line and field), and
    ``FileNotFoundError`` for a path that does not exist.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    text = os.fspath(name_or_path)
    key = _ALIASES.get(text, text)
    path = DATA_DIR / DATASETS[key] if key in DATASETS else Path(text)
    if key not in DATASETS and not path.is_file():
        names = ", ".join(DATASETS)
        if os.sep in text or "/" in text or path.suffix:
            raise FileNotFoundError(f"no such dataset file: {text} (bundled names: {names})")
        raise ValueError(
            f"unknown dataset {text!r}; {did_you_mean(text, _NAMES)}known names: {names}; "
            "or pass a path to a .jsonl file"
        )
    if path.name.endswith(".gz"):  # HumanEval as published: decompressed in memory
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    elif path.name.endswith(".zip"):  # GPQA: decompressed in memory only, as its authors ask
        with zipfile.ZipFile(path) as zf:
            member = _GPQA_MEMBER if _GPQA_MEMBER in zf.namelist() else zf.namelist()[0]
            lines = zf.read(member, pwd=_GPQA_PASSWORD).decode("utf-8").splitlines()
    else:
        lines = _read_lines(path)
    return _parse_rows(lines, path, "choice" if key == "gpqa" else "math", limit)


def grid_problems(
    name_or_path: str | os.PathLike[str], limit: int | None = None, after: str | None = None, before: str | None = None
) -> list[Problem]:
    """The problems an eval grid takes from one dataset: those whose contest day lies in ``[after, before]``
    (``YYYY-MM-DD``) when a window is given, then the first ``limit``.

    The one selection both a run (:func:`reasonkv.eval.plan.plan_grid`) and the check of its records against
    its manifest (:mod:`reasonkv.eval.record_match`) use.
    """
    if not (after or before):
        return load_dataset(name_or_path, limit=limit)
    first = parse_day(after, "--after") if after else None
    last = parse_day(before, "--before") if before else None
    return in_window(load_dataset(name_or_path), first, last, os.fspath(name_or_path))[:limit]


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (a byte-order mark is dropped); a line that is not UTF-8 is named."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    lines = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            lines.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path}, line {number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
                "save the file as UTF-8"
            ) from None
    return lines


def _parse_rows(lines: Iterable[str], path: Path, default_kind: Kind, limit: int | None) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(problems) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        problem = _row_to_problem(row, where, default_kind, path)
        if problem.id in seen:
            raise ValueError(f"{where}: field 'id': duplicate id {problem.id!r} (first on line {seen[problem.id]})")
        seen[problem.id] = lineno
        problems.append(problem)
    return problems


def _row_to_problem(row: dict[str, Any], where: str, default_kind: Kind, path: Path) -> Problem:
    code = code_fields(row, where, path.name)  # HumanEval, LiveCodeBench and code-* rows
    if code is not None:
        return Problem(**code)
    for name, other in _SPELLINGS.items():
        if name not in row and other in row:
            row = {name: row[other], **{k: v for k, v in row.items() if k != other}}
    missing = [name for name in _REQUIRED if _absent(row.get(name))]
    if missing:
        fields = ", ".join(map(repr, missing))
        raise ValueError(f"{where}: missing required field{'s' if len(missing) > 1 else ''} {fields} ({_FORMAT})")
    for name in _REQUIRED:
        value = row[name]
        if not isinstance(value, str) and not is_int(value):
            raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    kind = row.get("kind") or ("choice" if "choices" in row else default_kind)
    if kind not in _KINDS:
        raise ValueError(f"{where}: field 'kind' must be one of {_KINDS}, got {kind!r}")
    solution = row.get("solution")
    return Problem(
        id=str(row["id"]),
        problem=str(row["problem"]),
        answer=str(row["answer"]).strip(),
        source=str(row.get("source") or path.name),
        kind=kind,
        solution=None if solution is None else str(solution),
        extra={k: v for k, v in row.items() if k not in _KNOWN},
    )


def _absent(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())
