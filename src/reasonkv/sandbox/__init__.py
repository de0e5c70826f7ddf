"""Run untrusted Python programs (model-written code) behind a real boundary.

``run(source, stdin="", timeout=10.0, memory_mb=1024)`` runs one program in a fresh process, in a fresh
empty working directory, and returns a :class:`RunResult`: ``status`` (one of :data:`STATUSES`),
``returncode``, ``stdout``, ``stderr`` (capped) and ``isolation``, the mechanisms that were in force.

The boundary is bubblewrap (``bwrap``, the sandbox Flatpak uses): new user, PID, network and mount
namespaces, an unprivileged uid, a read-only system and private, size-capped tmpfs; resource limits,
the memory limit of the run as a whole (a cgroup of its own where the machine allows one, else the
supervisor's account: ``isolation`` names which), the output cap and the wall-clock kill of the whole
process tree are this package's own. Where bubblewrap is
missing or the kernel refuses unprivileged user namespaces, the sandbox names the guarantees that do
not hold (:data:`GUARANTEES`) and refuses to run until they are allowed explicitly:
``Sandbox(allow_missing=("network", ...)).run(...)``. Linux only.
"""

from __future__ import annotations

from reasonkv.sandbox.core import (
    GUARANTEES,
    OUTPUT_LIMIT,
    STATUSES,
    RunResult,
    Sandbox,
    SandboxUnavailable,
    Setup,
    probe,
)

__all__ = [
    "GUARANTEES",
    "OUTPUT_LIMIT",
    "STATUSES",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "Setup",
    "probe",
    "run",
]


def run(source: str, stdin: str = "", timeout: float = 10.0, memory_mb: int = 1024) -> RunResult:
    """Run the Python program ``source`` in the sandbox, with ``stdin`` as its standard input.

    ``timeout``: wall-clock seconds, at most 3600 (also its CPU-time limit), after which the whole process
    tree is killed; ``memory_mb``: the memory of the run, all its processes and files together (each
    process's address space is limited to it too), from 64 to the machine's memory. Raises
    :class:`SandboxUnavailable` when a guarantee of :data:`GUARANTEES` does not hold here (use
    :class:`Sandbox` with ``allow_missing`` to accept that).
    """
    return Sandbox().run(source, stdin, timeout, memory_mb)
