"""Run untrusted Python programs (model-written code) behind a real boundary.

``run(source, stdin="", timeout=10.0, memory_mb=1024)`` runs one program in a fresh process and empty working
directory and returns a :class:`RunResult`. The boundary is bubblewrap's namespaces; the limits, the memory of
the run as a whole, the output cap and the wall-clock kill are this package's own. Where bubblewrap cannot run,
the sandbox names the guarantees that do not hold (:data:`GUARANTEES`) and refuses until each is allowed
explicitly (``Sandbox(allow_missing=...)``). Linux only; what each mechanism guarantees: docs/sandbox.md.
"""

from __future__ import annotations

from reasonkv.sandbox.core import (
    GUARANTEES,
    OUTPUT_LIMIT,
    STATUSES,
    RunResult,
    Sandbox,
    SandboxUnavailable,
    probe,
)
from reasonkv.sandbox.host import Setup

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
