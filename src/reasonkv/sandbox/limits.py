"""The resource limits of a sandboxed program, and the launcher that sets them inside the sandbox.

The limits are set by a few lines of Python that run as the first process inside the sandbox and then
replace themselves with the program's interpreter (``execv``). Setting them there, after the sandbox's
user namespace exists, matters for the process count: the kernel counts ``RLIMIT_NPROC`` per user id
*per user namespace*, so every sandbox counts only its own processes, and sandboxes running side by
side never take process slots from each other (a limit set before the namespace is created would
also bind the namespace's owner, shared by all sandboxes of that uid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FILE_SIZE_MB", "LAUNCHER", "OPEN_FILES", "PROCESSES", "Limits", "launcher_argv"]

#: Largest file a program may write (MiB).
FILE_SIZE_MB = 16
#: Most open file descriptors per process.
OPEN_FILES = 128
#: Most processes and threads of the sandbox's user id, counted within its own user namespace.
PROCESSES = 64

# argv: ["-c", cpu, memory_bytes, file_bytes, open_files, processes, interpreter, *program argv]
LAUNCHER = (
    "import os, resource, sys\n"
    "cpu, memory, size, files, procs = (int(v) for v in sys.argv[1:6])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execv(sys.argv[6], sys.argv[6:])\n"
)


@dataclass(frozen=True)
class Limits:
    """Per-process limits: CPU seconds (SIGXCPU at ``cpu_seconds``, SIGKILL one second later), address
    space, file size, open files, and processes (threads included) of the sandbox."""

    cpu_seconds: int
    memory_mb: int
    file_size_mb: int = FILE_SIZE_MB
    open_files: int = OPEN_FILES
    processes: int = PROCESSES

    @classmethod
    def for_run(cls, timeout: float, memory_mb: int) -> Limits:
        """The limits of one run: CPU time as long as the wall-clock timeout (rounded up)."""
        return cls(cpu_seconds=max(1, math.ceil(timeout)), memory_mb=memory_mb)

    def values(self) -> list[int]:
        return [
            self.cpu_seconds,
            self.memory_mb * 2**20,
            self.file_size_mb * 2**20,
            self.open_files,
            self.processes,
        ]

    def describe(self) -> dict[str, int]:
        return {
            "cpu_seconds": self.cpu_seconds,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "open_files": self.open_files,
            "processes": self.processes,
        }


def launcher_argv(python: str, limits: Limits, program: list[str]) -> list[str]:
    """``python -I -S -c LAUNCHER <limits> <program...>``: set the limits, then exec ``program``."""
    return [python, "-I", "-S", "-c", LAUNCHER, *map(str, limits.values()), *program]
