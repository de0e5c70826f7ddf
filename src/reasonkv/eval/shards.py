"""One evaluation across processes: which shard this process is, its file, its lock, and the merge.

A run with ``--out results.jsonl`` split into ``N`` shards (``torchrun --nproc_per_node N -m reasonkv
eval ...``, or ``--shard I/N`` for schedulers that start independent jobs) writes shard ``I`` to
``results.shard-I-of-N.jsonl`` next to ``--out``; one process (``N = 1``) writes ``--out`` itself.
Every run reads the records of ``--out`` and of all its shard files, whatever their ``N``, so a
run resumes with any number of processes and skips exactly the units already on disk.

Locks (see :mod:`reasonkv.runs.outputs`): each process holds the lock of the file it writes. A sharded
process starts under the lock of ``--out`` (held for a moment), where it also makes sure no other
launch writes to the same run: a single process (which holds the lock of ``--out`` for its whole
run) or shards of another ``N``. Shards of the same ``N`` are one launch; one index twice is refused
by the shard's own lock.

Merge: the process that finds the whole grid done after writing its last record (the last to finish)
merges, under the lock of ``--out``: every record of every shard file that ``--out`` lacks is appended
(a unit already there, or an error record for a unit already there, is skipped: each unit appears
once), the file is synced, and then the shard files are deleted (each only once its writer has
finished and nothing was appended since it was read). A merge that is interrupted is simply done again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from reasonkv.eval.manifest import check_compatible
from reasonkv.eval.records import ResultsFile, scan_results, unit_key
from reasonkv.runs.outputs import OutputLock, OutputLocked

__all__ = ["Shard", "lock_for_writing", "merge_shards", "shard_files", "shard_path", "writer_path"]


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
        if isinstance(shard, str):
            return cls.parse(shard)
        index, count = shard
        return cls(index, count)

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


def _split(out: Path) -> tuple[str, str]:
    suffix = out.suffix
    return (out.name[: -len(suffix)] if suffix else out.name), suffix


def shard_path(out: str | os.PathLike[str], shard: Shard) -> Path:
    """``results.jsonl`` -> ``results.shard-I-of-N.jsonl`` (in the same folder)."""
    out = Path(out)
    stem, suffix = _split(out)
    return out.with_name(f"{stem}.shard-{shard.index}-of-{shard.count}{suffix}")


def writer_path(out: str | os.PathLike[str], shard: Shard) -> Path:
    """The file this shard writes: ``out`` itself for a single process."""
    return Path(out) if shard.count == 1 else shard_path(out, shard)


def _shard_pattern(out: Path, tail: str = "") -> re.Pattern:
    stem, suffix = _split(out)
    return re.compile(re.escape(stem) + r"\.shard-(\d+)-of-(\d+)" + re.escape(suffix + tail))


def shard_files(out: str | os.PathLike[str], *, locks: bool = False) -> list[tuple[Path, Shard]]:
    """The shard files next to ``out`` (of any shard count), or their lock files, in (N, I) order."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    pattern = _shard_pattern(out, ".lock" if locks else "")
    found = []
    for entry in out.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and int(match.group(1)) < int(match.group(2)):
            found.append((entry, Shard(int(match.group(1)), int(match.group(2)))))
    return sorted(found, key=lambda item: (item[1].count, item[1].index))


def _refuse_other_launches(out: Path, count: int) -> None:
    for path, shard in shard_files(out, locks=True):
        if shard.count == count:
            continue
        holder = OutputLock.holder(path)
        if holder is not None:
            raise OutputLocked(
                f"{out} is being written by a run split into {shard.count} shards "
                f"(shard {shard.label}: {OutputLock.describe(holder)}): wait for it to finish, or use another --out"
            )


def lock_for_writing(out: str | os.PathLike[str], shard: Shard) -> OutputLock:
    """Lock the file ``shard`` writes, refusing while another launch writes to the same run."""
    out = Path(out)
    if shard.count == 1:
        lock = OutputLock(out, "eval").acquire()
        try:
            _refuse_other_launches(out, 1)
        except BaseException:
            lock.release()
            raise
        return lock
    with OutputLock(out, "admission"):
        lock = OutputLock(shard_path(out, shard), "eval").acquire()
        try:
            _refuse_other_launches(out, shard.count)
        except BaseException:
            lock.release()
            raise
    return lock


def merge_shards(out: str | os.PathLike[str]) -> int | None:
    """Append the records of every shard file that ``out`` lacks, then delete the shard files.

    Returns the number of records appended, or ``None`` when a single-process run holds ``out`` (it
    merges when it finishes).
    """
    out = Path(out)
    try:
        lock = OutputLock(out, "merge").acquire()
    except OutputLocked:
        return None
    try:
        shards = shard_files(out)
        if not shards:
            return 0
        first = scan_results(shards[0][0], first_only=True)[0]
        settled: dict[tuple, int] = {}  # unit -> 1 (an error record), 2 (a result)

        def note(record: dict) -> None:
            key = unit_key(record)
            settled[key] = max(settled.get(key, 0), 1 if record.get("kind") == "error" else 2)

        results = ResultsFile(
            out, first, visit=note, check=lambda manifests: check_compatible(out, manifests, first), lock=False
        )
        ids = {m.get("id") for m in results.manifests}
        appended = 0
        sizes = {}

        def take(record: dict) -> None:
            nonlocal appended
            if record.get("kind") == "manifest":
                if record.get("id") not in ids:
                    check_compatible(out, results.manifests, record)
                    results.append(record)
                    ids.add(record.get("id"))
                return
            state = 1 if record.get("kind") == "error" else 2
            key = unit_key(record)
            if settled.get(key, 0) < state:
                results.append(record)
                settled[key] = state
                appended += 1

        with results:
            for path, _ in shards:
                sizes[path] = path.stat().st_size
                scan_results(path, take, include_manifests=True)
        for path, _ in shards:
            _delete_if_finished(path, sizes[path])
        return appended
    finally:
        lock.release()


def _delete_if_finished(path: Path, size: int) -> None:
    """Delete a merged shard file unless its writer still runs or it grew after it was read."""
    lock = OutputLock(path, "merge", wait_for=())
    try:
        lock.acquire()
    except OutputLocked:
        return
    try:
        if path.stat().st_size == size:
            path.unlink()
    finally:
        lock.release()
