"""Reading a reasonkv torch file a user names (a gate, query centers): one ``torch.save`` dict whose ``format``
entry names its kind, read with ``weights_only=True`` (anything more is refused, never loaded another way).
torch's own messages are replaced by what the file looks like: empty, text, a damaged archive, a pickle of
other objects, or a torch file of another kind."""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import torch

__all__ = ["read_torch_file"]

_ZIP = b"PK\x03\x04"  # torch.save's archive format
_PICKLE = 0x80  # a pickle (protocol 2 and later): torch.save's legacy format


def read_torch_file(path: str, fmt: str, kind: str, maker: str) -> dict[str, Any]:
    """The dict saved at ``path`` whose ``format`` is ``fmt``, or ``ValueError`` naming the path, what the file is,
    and what was expected (``kind``, e.g. ``gate file``, and its ``maker``, e.g. ``reasonkv calibrate --gates``)."""
    try:
        with warnings.catch_warnings():
            # torch warns, with a line of its own source, about a pickle protocol it may then refuse
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file: pickle, zip, os or torch errors alike
        what = _unreadable(path, error)
    else:
        if isinstance(payload, dict) and payload.get("format") == fmt:
            return payload
        what = _other(payload)
    raise ValueError(f"{path!r} is not a reasonkv {kind} ({what}); expected the output of {maker}")


def _unreadable(path: str, error: Exception) -> str:
    """What a file torch could not load looks like."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError as failure:
        return f"it could not be read: {failure.strerror or failure}"
    if not head:
        return "an empty file"
    if head.startswith(_ZIP):
        return f"a torch file of {size} bytes that could not be read: truncated or damaged"
    if head[0] == _PICKLE:
        if isinstance(error, pickle.UnpicklingError):
            return (
                f"a pickle of {size} bytes that the weights-only reader refused: it holds more than tensors, numbers "
                "and strings, or it is damaged; it was not loaded, since loading it any other way could run code"
            )
        return f"a pickle of {size} bytes that could not be read: truncated or damaged"
    if _is_text(head):
        return f"a text file of {size} bytes, not a torch file"
    return f"{size} bytes that are not a torch file (they start with {head[:8]!r})"


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text (a character cut at the end of ``head`` is allowed)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 3:
            return False
        text = head[: error.start].decode("utf-8")
    return all(c.isprintable() or c.isspace() for c in text)


def _other(payload: Any) -> str:
    """What a torch file of another kind holds."""
    if not isinstance(payload, dict):
        return f"a torch file holding a {type(payload).__name__}"
    if "format" not in payload:
        return "a torch file holding a dict without a 'format' entry"
    return f"a torch file of format {payload['format']!r}"
