"""What a run's manifest records of the machine and the model as loaded (needs torch and transformers;
:mod:`reasonkv.eval.manifest` reads and compares manifests without them)."""

from __future__ import annotations

import hashlib
import platform
from typing import Any

import torch

import reasonkv
from reasonkv.eval.manifest import git_commit
from reasonkv.hf import transformers_version
from reasonkv.runs.machine import cpu_model

__all__ = ["environment", "weights_sha256"]


def weights_sha256(model) -> str:
    """SHA-256 of every parameter's name, dtype, shape and bytes, in the model's order, as loaded."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}|{param.dtype}|{tuple(param.shape)}\n".encode())
        data = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def environment(device: str) -> dict[str, Any]:
    """The software and the device of this run."""
    commit, dirty = git_commit()
    return {
        "reasonkv": reasonkv.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "cuda": torch.version.cuda,
        "device": device.split(":")[0],
        "device_name": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else cpu_model(),
    }
