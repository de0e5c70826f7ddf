"""The GPU's SM clock beside each measured window: a step time is only comparable at a comparable clock.

A GPU lowers its clock when hot or power-capped, and a shared one may sit at another level for minutes;
recording the clock next to each window lets a reader tell a slow entry from a slow moment. Read in
order of cost: ``torch.cuda.clock_rate`` (through NVML, if its Python binding is installed), then
``nvidia-smi``; None when neither answers, and always on a CPU.
"""

from __future__ import annotations

import shutil
import subprocess

import torch

__all__ = ["gpu_clock_mhz"]

_NVIDIA_SMI_TIMEOUT_S = 5


def gpu_clock_mhz(device: torch.device) -> int | None:
    """The current SM clock of ``device`` in MHz, or None (a CPU, or no way to read it)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    reader = getattr(torch.cuda, "clock_rate", None)
    if reader is not None:
        try:
            return int(reader(index))
        except Exception:  # no NVML binding, or NVML refused: try the command-line tool
            pass
    return _nvidia_smi_clock(index)


def _nvidia_smi_clock(index: int) -> int | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, f"--id={index}", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
        return int(done.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
