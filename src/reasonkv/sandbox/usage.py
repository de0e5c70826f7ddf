"""The memory of one run as the supervisor accounts it from the host, where no cgroup can limit it.

The sum over the processes of its PID namespace of their proportional share of anonymous and shared-memory
pages (``Pss_Anon + Pss_Shmem``: a page a fork shares is split, not counted per process), plus what its tmpfs
and open memfds hold (a mapped one counts twice: the limit errs towards ending the run). Kernel-held memory
(pipe buffers, unmapped System V shared memory) is not seen; a cgroup counts it (:mod:`reasonkv.sandbox.cgroup`).
Everything is read through the sandbox's own ``/proc``, opened once as a folder descriptor, so a pid reused
after the run cannot make another process count.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["RunUsage"]

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_COUNTED = (b"Pss_Anon:", b"Pss_Shmem:")


def _read(name: str, dir_fd: int) -> bytes:
    with open(name, "rb", opener=lambda path, flags: os.open(path, flags | os.O_CLOEXEC, dir_fd=dir_fd)) as file:
        return file.read()


def _pages(pid: str, proc: int) -> int:
    """Bytes of ``pid``'s anonymous and shared-memory pages (its proportional share)."""
    try:
        rollup = _read(f"{pid}/smaps_rollup", proc)
    except PermissionError:  # a process that made itself undumpable: its whole resident size
        resident = int(_read(f"{pid}/statm", proc).split()[1])
        return resident * os.sysconf("SC_PAGE_SIZE")
    fields = dict(line.split()[:2] for line in rollup.splitlines() if line.endswith(b"kB"))
    if _COUNTED[0] not in fields:  # older kernels split no Pss by kind
        return int(fields.get(b"Pss:", 0)) * 1024
    return sum(int(fields.get(name, 0)) for name in _COUNTED) * 1024


def _memfds(pid: str, proc: int, seen: set[tuple[int, int]]) -> int:
    """Bytes of the memfds ``pid`` holds open and no other process counted yet."""
    try:
        fds = os.open(f"{pid}/fd", _OPEN_DIR, dir_fd=proc)
    except PermissionError:
        return 0
    total = 0
    try:
        for name in os.listdir(fds):
            try:
                if not os.readlink(name, dir_fd=fds).startswith("/memfd:"):
                    continue
                info = os.stat(name, dir_fd=fds)
            except OSError:
                continue  # closed meanwhile
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    finally:
        os.close(fds)
    return total


class RunUsage:
    """The memory a running sandbox uses, read from the host (see the module docstring)."""

    def __init__(self, proc: int, mounts: Sequence[int]):
        self._proc = proc
        self._mounts = tuple(mounts)

    @classmethod
    def attach(cls, pid: int, namespace: int, mounts: Sequence[str]) -> RunUsage:
        """Open the sandbox whose first process is host pid ``pid`` in PID namespace ``namespace``.

        Raises OSError while its root is not yet the sandbox's (bubblewrap still sets it up), or when ``pid``
        is no longer that process.
        """
        root = f"/proc/{pid}/root"
        proc = os.open(f"{root}/proc", _OPEN_DIR)
        opened = [proc]
        try:
            if os.fstat(proc).st_dev == os.stat("/proc").st_dev:
                raise OSError(f"the sandbox of process {pid} has no /proc of its own yet")
            if os.readlink(f"/proc/{pid}/ns/pid") != f"pid:[{namespace}]":
                raise OSError(f"process {pid} is not the sandbox's first process")
            for mount in mounts:
                opened.append(os.open(f"{root}{mount}", _OPEN_DIR | os.O_NOFOLLOW))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return cls(proc, opened[1:])

    def bytes(self) -> int:
        total = 0
        for fd in self._mounts:
            info = os.fstatvfs(fd)
            total += (info.f_blocks - info.f_bfree) * info.f_frsize
        seen: set[tuple[int, int]] = set()
        for name in os.listdir(self._proc):
            if name.isdigit():
                try:
                    total += _pages(name, self._proc) + _memfds(name, self._proc, seen)
                except (OSError, ValueError, IndexError):
                    continue  # the process ended between the listing and the reading
        return total

    def close(self) -> None:
        for fd in (self._proc, *self._mounts):
            os.close(fd)
        self._mounts = ()
        self._proc = -1
