"""How a model runs: its dtype, its device and its attention implementation, each checked before any load, so a
bad value fails at once with the allowed values.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["clear_attention_error", "resolve_attn_implementation", "resolve_device", "resolve_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"fp32"``/``"bf16"``/``"fp16"`` (or the long names, or a ``torch.dtype``) to a torch dtype
    (``ValueError`` listing the allowed names for any other value)."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    allowed = ", ".join(repr(k) for k in _DTYPES)
    raise ValueError(f"Unsupported dtype {dtype!r}; allowed: {allowed} (or the matching torch.dtype).")


def resolve_device(device: str | torch.device, *, allow_meta: bool = False) -> torch.device:
    """Validate a device (``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``; with ``allow_meta`` also
    ``"meta"``, for random-weight shapes) and return it as a ``torch.device``: ``ValueError`` for an unknown device
    or a CUDA device this machine does not have."""
    allowed = "'cpu', 'cuda', 'cuda:N'" + (", 'meta'" if allow_meta else "")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unsupported device {device!r}; allowed: {allowed}.") from None
    if dev.type == "cpu" or (dev.type == "meta" and allow_meta):
        return dev
    if dev.type != "cuda":
        raise ValueError(f"Unsupported device {device!r}; allowed: {allowed}.")
    if not torch.cuda.is_available():
        why = "no CUDA device is visible" if torch.version.cuda else f"torch {torch.__version__} has no CUDA support"
        raise ValueError(
            f"Device {device!r} requested but CUDA is not available ({why}); use the CPU: --device cpu on the "
            "command line, device='cpu' in Python."
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"Device {device!r} does not exist: {count} CUDA device(s) visible (cuda:0..{count - 1}).")
    return dev


def resolve_attn_implementation(attn_implementation: str, dtype: torch.dtype, device: torch.device) -> str:
    """Validate the attention implementation for the given dtype and device: ``ValueError`` for an unknown one, or
    flash_attention_2 on CPU or in fp32; ``ImportError`` for flash_attention_2 without ``flash_attn``."""
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        allowed = ", ".join(repr(a) for a in _ATTN_IMPLEMENTATIONS)
        raise ValueError(f"Unsupported attn_implementation {attn_implementation!r}; allowed: {allowed}.")
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ImportError(
                "attn_implementation='flash_attention_2' needs the flash_attn package, which is not "
                "installed; install it (CUDA only) or use attn_implementation='sdpa'."
            )
        if device.type != "cuda":
            raise ValueError(
                f"attn_implementation='flash_attention_2' needs a CUDA device, got device {str(device)!r}."
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attn_implementation='flash_attention_2' needs dtype bf16 or fp16, got {dtype}.")
    return attn_implementation


@contextmanager
def clear_attention_error(attn: str) -> Iterator[None]:
    """Turn transformers' refusal of an attention kernel for an architecture into one clear error (only the
    model's construction knows, so every loader builds the model inside this context)."""
    try:
        yield
    except ValueError as error:
        if "does not support an attention implementation" not in str(error):
            raise
        architecture = str(error).split(" does not support")[0].split()[-1]
        others = ", ".join(repr(a) for a in _ATTN_IMPLEMENTATIONS if a != attn)
        raise ValueError(
            f"{architecture} does not support attn_implementation={attn!r}; choose another ({others}), "
            "e.g. --attn eager"
        ) from None
