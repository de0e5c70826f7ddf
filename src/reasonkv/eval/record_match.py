"""Whether a record agrees with the manifest of the run that wrote it (the one its ``run`` names).

A record's cell, dataset, problem and setup are copies of its run's manifest; one that differs was edited,
or belongs to another run, and counted it would make a report row no grid had.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reasonkv.eval.datasets import dataset_path, grid_problems
from reasonkv.eval.manifest import file_sha256, shown
from reasonkv.eval.record_kinds import KINDS, SAMPLING, FidelityRecord, GenerationRecord, Record

__all__ = ["manifest_mismatch", "run_problems"]

# record field -> the manifest setup's field it copies (every kind of record; generations: SAMPLING too)
_SETUP = {"model": "model", "dtype": "dtype", "prompt_format": "prompt_format", "base_seed": "seed"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b  # True == 1 in Python, not in a record
    return a == b  # 0 == 0.0: the same setting once written to JSON


def _shown(value: Any) -> str:
    return shown(value, 60, sort_keys=True)


def _config_difference(here: Any, there: Any) -> str:
    """The first option in which two policy configs differ, in words."""
    if isinstance(here, Mapping) and isinstance(there, Mapping):
        for name in sorted(set(here) | set(there), key=str):
            if not _same(here.get(name), there.get(name)):
                return f"option {name!r} is {_shown(here.get(name))} here, {_shown(there.get(name))} in its run"
    return f"{_shown(here)} here, {_shown(there)} in its run"


def _dataset_file(entry: Mapping[str, Any]) -> Path | None:
    """The file a manifest's dataset entry was read from: the bundled file of its name, else the file it names."""
    name = str(entry.get("name"))
    with contextlib.suppress(ValueError):
        return dataset_path(name)
    for candidate in (entry.get("file"), name):
        if isinstance(candidate, str) and Path(candidate).is_file():
            return Path(candidate)
    return None


def run_problems(manifest: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """dataset name -> the ids of the problems it gave the run (its file read with the run's limit and date
    window); a dataset whose file is gone or changed (not the manifest's SHA-256) is left out."""
    grid = manifest["grid"]
    code = grid.get("code") if isinstance(grid.get("code"), Mapping) else {}
    known: dict[str, frozenset[str]] = {}
    for entry in grid.get("datasets", []):
        path, limit = _dataset_file(entry), entry.get("limit")
        if path is None or not (limit is None or isinstance(limit, int)):
            continue
        try:
            state = path.stat()
        except OSError:
            continue
        stamp = (state.st_size, state.st_mtime_ns, state.st_ctime_ns)
        window = (code.get("after"), code.get("before"))
        ids = _problem_ids(path.resolve(), stamp, str(entry.get("sha256")), limit, *window)
        if ids is not None:
            known[str(entry.get("name"))] = ids
    return known


@functools.lru_cache(maxsize=32)
def _problem_ids(
    path: Path, stamp: tuple[int, int, int], sha256: str, limit: int | None, after: str | None, before: str | None
) -> frozenset[str] | None:
    """The ids :func:`run_problems` reads, None when ``path`` is not the file the run read; cached while its
    ``stamp`` (size, times) stays, as a resume scans its files several times and a dataset may be large."""
    if file_sha256(path) != sha256:
        return None
    try:
        return frozenset(p.id for p in grid_problems(path, limit, after, before))
    except (OSError, ValueError):
        return None  # the file the run read loads; this one does not, so it is not that file


def manifest_mismatch(
    record: Mapping[str, Any], manifest: Mapping[str, Any], problems: Mapping[str, frozenset[str]] | None = None
) -> str | None:
    """The first field in which ``record`` differs from its run's sound ``manifest``, in words; None when it
    agrees. Only the fields the record holds are compared, and the cell's budget and buffer always
    (``problems``: :func:`run_problems` of ``manifest``, computed when not given)."""
    setup, grid = manifest["setup"], manifest["grid"]
    run = f"run {manifest['id']}"
    datasets = [d["name"] for d in grid.get("datasets", [])]
    if "dataset" in record and datasets and record.get("dataset") not in datasets:
        return f"field 'dataset' is {_shown(record.get('dataset'))}, not a dataset of its {run} ({', '.join(datasets)})"
    if "problem_id" in record:
        problems = run_problems(manifest) if problems is None else problems
        ids = problems.get(str(record.get("dataset")))
        if ids is not None and str(record["problem_id"]) not in ids:
            return (
                f"field 'problem_id' is {_shown(record['problem_id'])}, not one of the {len(ids)} problems of "
                f"{record.get('dataset')} in its {run}"
            )
    unit = Record.read(record).unit if record.get("kind") in KINDS else None
    compared = dict(_SETUP)
    if unit == GenerationRecord.kind:
        compared.update({name: name for name in SAMPLING})
    for name, there in compared.items():
        if name in record and there in setup and not _same(record[name], setup[there]):
            return f"field '{name}' is {_shown(record[name])}, but its {run} has {_shown(setup[there])}"
    replays = grid.get("fidelity_tokens") if grid.get("fidelity") else None
    if unit == FidelityRecord.kind and replays is not None and not _same(record.get("fidelity_tokens"), replays):
        return f"field 'fidelity_tokens' is {_shown(record.get('fidelity_tokens'))}, but its {run} replays {replays}"
    return _cell_mismatch(record, grid.get("policies", []), run)


def _cell_mismatch(record: Mapping[str, Any], cells: list[Mapping[str, Any]], run: str) -> str | None:
    if not cells or "policy_label" not in record:
        return None
    label = record.get("policy_label")
    same_label = [c for c in cells if c.get("label") == label]
    if not same_label:
        labels = ", ".join(dict.fromkeys(str(c.get("label")) for c in cells))
        return f"field 'policy_label' is {_shown(label)}, not a policy of its {run} ({labels})"
    budget = record.get("budget")
    cell = next((c for c in same_label if _same(c.get("budget"), budget)), None)
    if cell is None:
        budgets = ", ".join(str(c.get("budget")) for c in same_label)
        return f"field 'budget' is {_shown(budget)}, not a budget of {label} in its {run} ({budgets})"
    if not _same(record.get("buffer"), cell.get("buffer")):
        return f"field 'buffer' is {_shown(record.get('buffer'))}, but its {run} has {_shown(cell.get('buffer'))}"
    if "policy_config" in record and "config" in cell and not _same(record["policy_config"], cell["config"]):
        where = label if budget is None else f"{label}@{budget}"
        return f"field 'policy_config' differs from its {run}'s {where}: " + _config_difference(
            record["policy_config"], cell["config"]
        )
    return None
