"""Recognising out-of-memory failures, which torch raises under several types."""

from __future__ import annotations

import sys

__all__ = ["is_out_of_memory"]

# What torch's CPU allocator and CUDA caching allocator say when an allocation fails.
_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a failed allocation: ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA), or
    the ``RuntimeError`` of torch's CPU allocator."""
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _MESSAGES)
