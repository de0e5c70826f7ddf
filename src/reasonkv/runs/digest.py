"""A file's SHA-256, read in blocks: what results record of their inputs and what a model copy records of its
files (torch-free, so ``reasonkv report`` can check a results file without it)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["file_sha256"]


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
