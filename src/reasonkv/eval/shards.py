"""One evaluation across processes: which shard this process is, its file, its locks, its plan, and the merge.

Shard ``I`` of ``N`` writes ``results.shard-I-of-N.jsonl`` next to ``--out results.jsonl``; one process writes
``--out`` itself. Every run reads ``--out`` and all its shard files, whatever their ``N``, so it resumes with any
number of processes. A process joins the run (:func:`join_run`) before its model loads, under the run's steps
lock (``results.jsonl.steps.lock``, waited for): it takes the lock of the file it writes and refuses another
launch, a shard file of another grid (never merged, never deleted) and a process of the run with other
settings (the plan file ``results.plan.json``: ranks with different grids would compute different splits). The
process that finds the whole grid done merges (:func:`merge_shards`): every record of the shard files that
``--out`` lacks is appended once, then each shard file whose writer has finished is deleted, and the plan file
with the last. An interrupted merge is simply done again. The rules for users: docs/eval-at-scale.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonkv.eval.manifest import check_compatible, differences, grid_differences, grid_identity, grid_sha256
from reasonkv.eval.record_kinds import ManifestRecord, Record
from reasonkv.eval.records import ResultsFile, repair_results, scan_results
from reasonkv.runs.outputs import (
    OutputError,
    OutputLock,
    OutputLocked,
    lock_path,
    remove_stale_temps,
    warn,
    write_atomic,
)

__all__ = [
    "Shard",
    "join_run",
    "merge_shards",
    "plan_path",
    "read_run",
    "run_files",
    "shard_files",
    "shard_path",
    "steps_lock_path",
    "writer_path",
]

STEPS_WAIT = 600.0  # the longest a process waits for another's short step (joining, merging)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``; ``local_rank`` is the launcher's per-machine rank (picks the GPU)."""

    index: int = 0
    count: int = 1
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and isinstance(self.index, int)):
            raise ValueError(f"a shard is I/N with integers N >= 1, got {self.index}/{self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in 0..{self.count - 1}, got {self.index} (shard I/N counts from 0)")

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"1/4"`` -> shard 1 of 4."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if not match:
            raise ValueError(f"--shard takes I/N (shard I of N, counted from 0), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Shard | None:
        """The shard a ``torch.distributed`` launcher (torchrun) gave this process, or ``None``."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return None
        try:
            world, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise ValueError(
                f"WORLD_SIZE / RANK / LOCAL_RANK must be integers, got {env.get('WORLD_SIZE')!r} / "
                f"{env.get('RANK')!r} / {env.get('LOCAL_RANK')!r}"
            ) from None
        return cls(rank, world, local)

    @classmethod
    def resolve(cls, shard: Shard | str | tuple[int, int] | None, env: Mapping[str, str] | None = None) -> Shard:
        """The shard of this process: given (``"I/N"``, ``(I, N)``), from the launcher, or the whole grid."""
        launched = cls.from_env(env)
        if shard is None:
            return launched or cls()
        if launched is not None and launched.count > 1:
            raise ValueError(
                f"--shard {shard if isinstance(shard, str) else ''} and a launcher with {launched.count} processes: "
                "the launcher already splits the grid (WORLD_SIZE/RANK); drop --shard"
            )
        if isinstance(shard, Shard):
            return shard
        return cls.parse(shard) if isinstance(shard, str) else cls(*shard)

    def device(self, device: str) -> str:
        """The device of this process: ``cuda`` becomes ``cuda:LOCAL_RANK`` under a launcher."""
        if self.local_rank is None or self.count == 1 or not str(device).startswith("cuda"):
            return device
        if str(device) != "cuda":
            raise ValueError(
                f"--device {device} names one GPU, but the launcher started {self.count} processes: "
                "give --device cuda (each process takes cuda:LOCAL_RANK)"
            )
        return f"cuda:{self.local_rank}"


def shard_path(out: str | os.PathLike[str], shard: Shard) -> Path:
    """``results.jsonl`` -> ``results.shard-I-of-N.jsonl`` (in the same folder)."""
    out = Path(out)
    return out.with_name(f"{out.stem}.shard-{shard.index}-of-{shard.count}{out.suffix}")


def writer_path(out: str | os.PathLike[str], shard: Shard) -> Path:
    """The file this shard writes: ``out`` itself for a single process."""
    return Path(out) if shard.count == 1 else shard_path(out, shard)


def shard_files(out: str | os.PathLike[str], *, locks: bool = False) -> list[tuple[Path, Shard]]:
    """The shard files next to ``out`` (of any shard count), or their lock files, in (N, I) order."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    tail = out.suffix + (".lock" if locks else "")
    pattern = re.compile(re.escape(out.stem) + r"\.shard-(\d+)-of-(\d+)" + re.escape(tail))
    matches = [(entry, pattern.fullmatch(entry.name)) for entry in out.parent.iterdir()]
    found = [(entry, Shard(int(m[1]), int(m[2]))) for entry, m in matches if m and int(m[1]) < int(m[2])]
    return sorted(found, key=lambda item: (item[1].count, item[1].index))


def steps_lock_path(out: str | os.PathLike[str]) -> Path:
    """``results.jsonl.steps.lock``: the lock of a run's short steps (joining it, merging it)."""
    out = Path(out)
    return out.with_name(out.name + ".steps.lock")


def plan_path(out: str | os.PathLike[str]) -> Path:
    """``results.plan.json``: what every process of a sharded run must agree on."""
    out = Path(out)
    return out.with_name(f"{out.stem}.plan.json")


def _plan_of(path: Path) -> dict:
    """The plan a results file was written under, from its first manifest (see :func:`join_run`)."""
    first = scan_results(path, first_only=True)[0]
    grid = grid_identity(first["grid"], first["setup"])
    return {"sha256": grid_sha256(grid), "grid": grid, "model": first["setup"].get("model"),
            "dtype": first["setup"].get("dtype")}  # fmt: skip


def run_files(out: str | os.PathLike[str], grid: str | None = None) -> list[Path]:
    """``out`` (when it exists) and its shard files (only those of ``grid``, a grid SHA-256, when given)."""
    out = Path(out)
    shards = [p for p, _ in shard_files(out)]
    if grid is not None:
        shards = [p for p in shards if _plan_of(p)["sha256"] == grid]
    return [p for p in [out] if p.exists()] + shards


def read_run(
    out: str | os.PathLike[str],
    grid: str,
    visit: Callable[[dict[str, Any]], None],
    *,
    exclude: Path | None = None,
) -> dict[Path, list[dict[str, Any]]]:
    """Pass every record of ``out`` and its shard files of ``grid`` (but ``exclude``) to ``visit``; returns each
    file's manifests. Read under the steps lock: a merge meanwhile could move a unit or delete a file."""
    with OutputLock(out, "read", path=steps_lock_path(out), wait=STEPS_WAIT):
        return {path: scan_results(path, visit) for path in run_files(out, grid) if path != exclude}


def _refuse_other_launches(out: Path, shard: Shard) -> None:
    if shard.count > 1:
        holder = OutputLock.holder(lock_path(out))
        if holder is not None:
            raise OutputLocked(
                f"{out} is in use by {OutputLock.describe(holder)}, a single process: wait for it to finish, or "
                "use another --out"
            )
    for path, other in shard_files(out, locks=True):
        if other.count == shard.count and shard.count > 1:
            continue
        holder = OutputLock.holder(path)
        if holder is not None:
            raise OutputLocked(
                f"{out} is being written by a run split into {other.count} shards "
                f"(shard {other.label}: {OutputLock.describe(holder)}): wait for it to finish, or use another --out"
            )


def _refuse_foreign_shards(out: Path, plan: dict) -> None:
    """Refuse shard files written with another grid (never merged, never deleted) or another model or dtype."""
    for path, _ in shard_files(out):
        theirs = _plan_of(path)
        if theirs["sha256"] != plan["sha256"]:
            differences = "; ".join(grid_differences(theirs["grid"], plan["grid"]))
            raise ValueError(
                f"{path} is a shard of a run with another grid ({differences}): "
                f"it is never merged into {out} or deleted. Finish that run first (its own command, with any number "
                "of processes), or move the file away"
            )
        differences = _plan_differences(theirs, plan)
        if differences:
            raise ValueError(
                f"{path} holds results of another setup ({'; '.join(differences)}): results of two setups never "
                "share a run; use another --out, or the same settings to resume"
            )


def _read_plan(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        found = None
    if not isinstance(found, dict) or found.get("tool") != "reasonkv" or found.get("kind") != "plan":
        raise ValueError(f"{path} is not a reasonkv plan file: move it away or use another --out")
    return found


def _plan_differences(old: dict, new: dict) -> list[str]:
    found = differences(old, new, ("model", "dtype"))
    if old.get("sha256") != new["sha256"]:
        found += grid_differences(old.get("grid") if isinstance(old.get("grid"), dict) else {}, new["grid"])
    return found


def _check_plan(out: Path, shard: Shard, plan: dict) -> None:
    """Refuse a plan that differs from the one of the processes in the run; a sharded process records it."""
    path = plan_path(out)
    found = _read_plan(path)
    others = [p for p, s in shard_files(out, locks=True) if s != shard and OutputLock.holder(p) is not None]
    live = bool(shard_files(out) or others)
    if found is not None and live:
        differences = _plan_differences(found, plan)
        if differences:
            raise ValueError(
                f"{out} is being run with other settings ({'; '.join(differences)}; the run's plan is {path}): every "
                "process of a run needs the same arguments, or the processes would split different grids; use "
                "another --out, or the same arguments"
            )
    if shard.count > 1 and found != plan:  # the first process of a launch (every check above passed)
        remove_stale_temps(path)
        write_atomic(path, json.dumps(plan, indent=1) + "\n")


def _unless_written(path: Path, purpose: str) -> OutputLock | None:
    """The lock of ``path`` (held), or None while another process holds it."""
    try:
        return OutputLock(path, purpose).acquire()
    except OutputLocked:
        return None


def _repair(out: Path) -> list[str]:
    """Move the lines that are not records out of the run's files nobody writes now."""
    done = []
    for path in run_files(out):
        lock = _unless_written(path, "repair")
        if lock is None:
            continue  # its writer repaired it when it joined
        try:
            note = repair_results(path)
        finally:
            lock.release()
        if note is not None:
            done.append(note)
    return done


def join_run(
    out: str | os.PathLike[str], shard: Shard, plan: dict, *, repair: bool = False
) -> tuple[OutputLock, list[str]]:
    """Take this process's place in the run writing ``out``, before any model loads (see the module docstring).

    ``plan`` is this process's plan record (``sha256`` and ``grid``: the grid's identity, ``model``, ``dtype``).
    Returns the lock of the file this process writes (held; the caller releases it) and, with ``repair``, what
    :func:`~reasonkv.eval.records.repair_results` did. Raises :class:`OutputLocked` or ``ValueError``.
    """
    out = Path(out)
    with OutputLock(out, "join", path=steps_lock_path(out), wait=STEPS_WAIT):
        notes = _repair(out) if repair else []
        lock = OutputLock(writer_path(out, shard), "eval").acquire()
        try:
            _refuse_other_launches(out, shard)
            _refuse_foreign_shards(out, plan)
            _check_plan(out, shard, plan)
        except BaseException:
            lock.release()
            raise
    return lock, notes


def merge_shards(out: str | os.PathLike[str], grid: str) -> int | None:
    """Append the records of every shard file of ``grid`` (a grid SHA-256) that ``out`` lacks, then delete them.

    Shard files of another grid are left as they are (a warning). Returns the number of records
    appended, or ``None`` when a single-process run holds ``out`` (it merges when it finishes).
    """
    out = Path(out)
    with OutputLock(out, "merge", path=steps_lock_path(out), wait=STEPS_WAIT):
        lock = _unless_written(out, "merge")
        if lock is None:
            return None
        try:
            shards = []
            for path, _ in shard_files(out):
                if _plan_of(path)["sha256"] == grid:
                    shards.append(path)
                else:
                    warn(f"{path} holds another grid: it was not merged into {out}, nor deleted")
            appended, sizes = _merge(lock, shards) if shards else (0, {})
            for path, size in sizes.items():
                _delete_if_finished(path, size, out)
            if not shard_files(out) and plan_path(out).exists():
                _remove(plan_path(out), "the run is merged")
            return appended
        finally:
            lock.release()


def _merge(lock: OutputLock, shards: list[Path]) -> tuple[int, dict[Path, int]]:
    """Append what the output ``lock`` guards lacks of ``shards``; returns the count and each shard's size as read."""
    out = lock.target
    first = scan_results(shards[0], first_only=True)[0]
    settled: dict[tuple, int] = {}  # unit -> 1 (an error record), 2 (a result)

    def note(data: dict) -> None:
        record = Record.read(data)
        settled[record.key()] = max(settled.get(record.key(), 0), 2 if record.result else 1)

    appended = 0
    sizes: dict[Path, int] = {}
    try:
        results = ResultsFile(
            out, first, visit=note, check=lambda manifests: check_compatible(out, manifests, first), lock=lock
        )
        ids = {m.get("id") for m in results.manifests}

        def take(data: dict) -> None:
            nonlocal appended
            record = Record.read(data)
            if isinstance(record, ManifestRecord):
                if data.get("id") not in ids:
                    check_compatible(out, results.manifests, data)
                    results.append(record)
                    ids.add(data.get("id"))
                return
            state = 2 if record.result else 1
            key = record.key()
            if settled.get(key, 0) < state:
                results.append(record)
                settled[key] = state
                appended += 1

        with results:
            for path in shards:
                sizes[path] = path.stat().st_size
                scan_results(path, take, include_manifests=True)
    except OutputError as error:
        raise OutputError(
            f"merging the shard files into {out}: {error} (the shard files are complete and kept)"
        ) from error
    return appended, sizes


def _delete_if_finished(path: Path, size: int, out: Path) -> None:
    """Delete a merged shard file unless its writer still runs or it grew after it was read."""
    try:
        lock = _unless_written(path, "merge")
    except OSError as error:
        warn(f"could not check whether {path} is still written ({error}); its records are in {out}: delete it yourself")
        return
    if lock is None:
        return
    try:
        if path.stat().st_size == size:
            _remove(path, f"its records are in {out}")
    finally:
        lock.release()


def _remove(path: Path, why: str) -> None:
    """Delete a file the run no longer needs; failing to is a warning (the work is done)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        warn(f"could not delete {path} ({error.strerror or error}); {why}: delete it yourself")
