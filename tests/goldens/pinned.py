"""The numeric environment goldens are observed in, the same on every x86 machine.

A greedy decode on a tiny random model meets near-ties, and CPUs' kernels sum in different orders (AVX-512
against AVX2 code in PyTorch's own kernels, MKL's and oneDNN's per-CPU paths, the threads a reduction is split
over): a logit one rounding step apart then picks another token or keeps another position. So the goldens are
recorded and compared with the kernels pinned to their AVX2 paths and two threads, set before torch loads
(torch reads these variables when it starts). Numbered results (the eval grid's KL) are then equal too.
"""

from __future__ import annotations

import os
import sys

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorised kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
}


def pinned_environment() -> dict[str, str]:
    """This process's environment with the numeric settings pinned (for a child process)."""
    return {**os.environ, **PINNED}


def is_pinned() -> bool:
    return all(os.environ.get(name) == value for name, value in PINNED.items())


def ensure_pinned() -> None:
    """Run this script again with the pinned environment unless it has it (before torch is imported)."""
    if not is_pinned():
        if "torch" in sys.modules:
            raise RuntimeError("the golden environment must be pinned before torch is imported")
        os.execve(sys.executable, [sys.executable, *sys.argv], pinned_environment())
