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
import os
from dataclasses import dataclass

from reasonkv.suggest.integers import is_int, is_number

__all__ = [
    "FILE_SIZE_MB",
    "LAUNCHER",
    "MAX_TIMEOUT",
    "MIN_MEMORY_MB",
    "OPEN_FILES",
    "PROCESSES",
    "Limits",
    "check_memory",
    "check_timeout",
    "launcher_argv",
    "machine_memory_mb",
]

#: Largest file a program may write (MiB).
FILE_SIZE_MB = 16
#: Most open file descriptors per process.
OPEN_FILES = 128
#: Most processes and threads of the sandbox's user id, counted within its own user namespace. The run's
#: memory is limited as a whole, so this no longer multiplies it; it bounds a fork bomb's load on the machine.
PROCESSES = 32
#: Longest run (seconds): a test that needs an hour is not a unit test, and far longer deadlines overflow
#: the kernel's timers (an epoll timeout is an int of milliseconds: about 24.8 days).
MAX_TIMEOUT = 3600.0
#: Smallest memory limit (MiB): the interpreter alone needs about 10 MiB, and its address space more.
MIN_MEMORY_MB = 64


def machine_memory_mb() -> int:
    """This machine's physical memory in MiB: the largest memory limit that still limits anything."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """``timeout`` as float seconds, or ValueError naming the value and the allowed range."""
    if not is_number(timeout) or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
    return float(timeout)


def check_memory(memory_mb: object, name: str = "memory_mb") -> int:
    """``memory_mb`` if it is an integer from :data:`MIN_MEMORY_MB` to this machine's memory, else ValueError."""
    top = machine_memory_mb()
    if not is_int(memory_mb) or not MIN_MEMORY_MB <= memory_mb <= top:
        raise ValueError(
            f"{name} must be an integer number of MiB from {MIN_MEMORY_MB} to {top} (this machine's memory), "
            f"got {memory_mb!r}"
        )
    return memory_mb


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
    space, file size, open files, and processes (threads included) of the sandbox. The address-space limit
    stays per process (a ``MemoryError`` is clearer than a kill); the run as a whole is limited apart
    (:mod:`reasonkv.sandbox.cgroup`, :mod:`reasonkv.sandbox.usage`)."""

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
        return [self.cpu_seconds, self.memory_mb * 2**20, self.file_size_mb * 2**20, self.open_files, self.processes]


def launcher_argv(python: str, limits: Limits, program: list[str]) -> list[str]:
    """``python -I -S -c LAUNCHER <limits> <program...>``: set the limits, then exec ``program``."""
    return [python, "-I", "-S", "-c", LAUNCHER, *map(str, limits.values()), *program]
