"""What machine a run is on, for the records that describe it (bench documents, eval manifests)."""

from __future__ import annotations

import contextlib
import platform

__all__ = ["cpu_model"]


def cpu_model() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` where there is one)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
