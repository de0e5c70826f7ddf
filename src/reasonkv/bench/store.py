"""Where results go: one JSON line per finished (mode, policy, batch) entry, appended as measured.

A rerun with the same output folder skips the finished entries. A mode's configuration is stored in every
record: resuming with a different one is refused, so one folder never mixes two set-ups. The folder is
claimed first (:func:`claim_output`) and stays locked while the bench runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from reasonkv.runs.outputs import ClaimedFolder, claim_folder
from reasonkv.runs.store import JsonlStore, json_safe, read_records

__all__ = ["OUTPUT_FILES", "RESULTS_FILE", "ResultStore", "claim_output", "entry_key", "now_iso"]

RESULTS_FILE = "results.jsonl"
#: Every file a bench writes into its folder.
OUTPUT_FILES = (RESULTS_FILE, "bench.json", "bench.md")
OUTPUT_FILES += ("step_time.png", "memory.png", "throughput.png", "eviction_cost.png")  # bench.plots


def _is_old_bench_folder(folder: Path) -> bool:
    """A bench folder from before output markers: its results.jsonl starts with a bench record."""
    try:
        with open(folder / RESULTS_FILE, encoding="utf-8") as handle:
            first = json.loads(handle.readline())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(first, dict) and {"mode", "policy", "status"} <= set(first)


def claim_output(out: str | os.PathLike[str]) -> ClaimedFolder:
    """Claim and lock the bench's ``--out`` folder."""
    return claim_folder(out, "bench", OUTPUT_FILES, recognise=_is_old_bench_folder)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def entry_key(mode: str, policy: str, batch: int | None, options: dict) -> tuple:
    return (mode, policy, batch, json.dumps(options, sort_keys=True, default=str))


def _key(record: dict) -> tuple:
    return entry_key(record["mode"], record["policy"], record.get("batch"), record.get("options", {}))


class ResultStore:
    """The records of one output folder (``results.jsonl``)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} exists and is not a folder")
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / RESULTS_FILE
        self._file = JsonlStore(self.path, fsync=True)  # the claimed folder's lock covers it
        self.records: list[dict] = read_records(self.path)

    def ok(self, mode: str | None = None) -> list[dict]:
        """Finished records (optionally of one mode), the latest per entry."""
        latest: dict[tuple, dict] = {}
        for record in self.records:
            if record.get("status") == "ok" and (mode is None or record.get("mode") == mode):
                latest[_key(record)] = record
        return list(latest.values())

    def done(self, mode: str, policy: str, batch: int | None, options: dict) -> bool:
        key = entry_key(mode, policy, batch, options)
        return any(_key(r) == key for r in self.ok(mode))

    def check_config(self, mode: str, config: dict, *, force: bool, rerun: list[tuple] = ()) -> int:
        """Refuse to mix configurations of ``mode``. With ``force``, drop its records of another configuration and
        those of the entries in ``rerun`` (keys from :func:`entry_key`, measured again); returns how many."""
        config = json_safe(config)
        mine = [r for r in self.records if r.get("mode") == mode]
        differing = [r for r in mine if r.get("status") == "ok" and r.get("config", {}) != config]
        if differing and not force:
            old = differing[0].get("config", {})
            differences = ", ".join(
                f"{k}: {old.get(k)!r} there, {config.get(k)!r} now"
                for k in sorted(set(old) | set(config))
                if old.get(k) != config.get(k)
            )
            raise ValueError(
                f"{self.out} holds {mode} results measured with another configuration ({differences}); "
                "pass --force to re-measure them, or use another --out"
            )
        if not force:
            return 0
        rerun = set(rerun)
        before = len(self.records)
        self.records = [
            r for r in self.records if r.get("mode") != mode or (r.get("config", {}) == config and _key(r) not in rerun)
        ]
        if len(self.records) != before:
            self._file.rewrite(self.records)
        return before - len(self.records)

    def add(self, record: dict) -> dict:
        """Append ``record`` (made JSON-safe) to the file, on disk at once; returns it as it reads back."""
        record = self._file.append(record)
        self.records.append(record)
        return record
