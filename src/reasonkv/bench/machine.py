"""What a bench measured on: CPU, GPU and library versions, for ``bench.json`` and every record."""

from __future__ import annotations

import os
import platform

import torch

import reasonkv
from reasonkv.hf import transformers_version
from reasonkv.runs.machine import cpu_model

__all__ = ["machine_info"]


def machine_info(device: torch.device) -> dict:
    """CPU, GPU, library versions: what the numbers were measured on."""
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "reasonkv": reasonkv.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "gpu_memory_bytes": None,
    }
    if getattr(device, "type", None) == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory))
    return info
