"""A cgroup (v2) for each run, where this machine lets one be made: the kernel then limits the run's memory
as a whole (every process, its tmpfs pages, its pipes and sockets) and its number of processes.

A group is made under a parent that already hands the ``memory`` and ``pids`` controllers down (this process's
own cgroup, else the cgroup2 root); nothing is enabled on a parent (cgroup v2's "no internal processes" rule, and
a machine's layout is not ours to change). ``memory.oom.group`` makes an out-of-memory kill end the whole run,
and ``memory.events`` tells afterwards. Where no parent fits, :func:`find_parent` says why and the supervisor
accounts the memory instead (:mod:`reasonkv.sandbox.usage`).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

__all__ = ["RunGroup", "find_parent"]

_CONTROLLERS = ("memory", "pids")
_COUNTER = itertools.count()
_EMPTY_WAIT = 2.0  # seconds to wait for the group's processes to be gone before removing it


def _cgroup2_mount(mountinfo: str) -> Path | None:
    for line in mountinfo.splitlines():
        if " - " in line and line.split(" - ", 1)[1].split()[0] == "cgroup2":
            return Path(line.split()[4])
    return None


def find_parent(mountinfo: str | None = None, cgroups: str | None = None) -> tuple[Path | None, str]:
    """``(parent, "")``: a folder where a run's group can be made and limited; else ``(None, why not)``.

    ``mountinfo``, ``cgroups``: this process's ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` (read
    when None).
    """
    mount = _cgroup2_mount(Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo)
    if mount is None:
        return None, "no cgroup2 file system is mounted"
    cgroups = Path("/proc/self/cgroup").read_text() if cgroups is None else cgroups
    own = next((line[3:] for line in cgroups.splitlines() if line.startswith("0::")), None)
    candidates = [mount / own.lstrip("/")] if own and own != "/" else []
    reasons = []
    for parent in dict.fromkeys([*candidates, mount]):
        try:
            offered = (parent / "cgroup.controllers").read_text().split()
            handed = (parent / "cgroup.subtree_control").read_text().split()
        except OSError as error:
            reasons.append(f"{parent}: {error.strerror or error}")
            continue
        lacking = [name for name in _CONTROLLERS if name not in handed]
        if lacking:
            where = "hands down" if all(name in offered for name in lacking) else "offers"
            reasons.append(f"{parent} {where} no {'/'.join(lacking)} controller")
            continue
        try:
            RunGroup.create(parent, memory_mb=64, processes=4).remove()
        except OSError as error:
            reasons.append(f"{parent}: cannot make a limited group ({error.strerror or error})")
            continue
        return parent, ""
    return None, "; ".join(reasons)


class RunGroup:
    """One run's cgroup: its memory (swap excluded) and process count limited, killed whole on OOM."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, parent: Path, *, memory_mb: int, processes: int) -> RunGroup:
        path = parent / f"reasonkv-sandbox-{os.getpid()}-{next(_COUNTER)}"
        path.mkdir(mode=0o755)
        group = cls(path)
        try:
            group._write("memory.max", str(memory_mb * 2**20))
            if (path / "memory.swap.max").exists():  # without swap accounting there is no swap to limit
                group._write("memory.swap.max", "0")
            group._write("memory.oom.group", "1")
            group._write("pids.max", str(processes))
        except OSError:
            group.remove()
            raise
        return group

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group (its later children are born there)."""
        self._write("cgroup.procs", str(pid))

    def members(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def oom_killed(self) -> bool:
        try:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(events.get("oom_kill", 0)) > 0 or int(events.get("oom_group_kill", 0)) > 0

    def remove(self) -> bool:
        """Kill what is left in the group and remove it (a group with processes cannot be removed); False
        when it could not be removed."""
        try:
            if (self.path / "cgroup.kill").exists():
                self._write("cgroup.kill", "1")
            deadline = time.monotonic() + _EMPTY_WAIT
            while self.members() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
