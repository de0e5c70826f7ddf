"""The output paths a command is given, checked before the model loads: a missing folder, or one where no file
can be created, is a one-line error at once, not an ``[Errno 2]`` or ``[Errno 13]`` after minutes of decoding."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_output_file", "check_results_path"]


def check_output_file(path: Path, flag: str) -> Path:
    """``path`` if a file can be written there now: its folder exists, is a folder and is writable."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder: name a file")
    folder = path.parent
    if not folder.exists():
        raise FileNotFoundError(f"{flag} {path}: the folder {folder} does not exist; create it first or choose another")
    if not folder.is_dir():
        raise NotADirectoryError(f"{flag} {path}: {folder} is a file, not a folder")
    # Create and remove a file in the folder: the one test that also holds for root, read-only mounts and
    # filesystems such as /sys, where permission bits (os.access) say yes. The probe's name is new (mkstemp), so
    # no file of the user's is touched.
    try:
        handle, probe = tempfile.mkstemp(prefix=".reasonkv-probe-", dir=folder)
    except OSError as error:
        raise PermissionError(
            f"{flag} {path}: cannot create a file in the folder {folder} ({error.strerror or error}); "
            "choose another folder"
        ) from None
    os.close(handle)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"{flag} {path} exists and is not writable")
    return path


def check_results_path(path: Path, flag: str = "--out") -> Path:
    """``eval``'s results file: its own folder is created when missing (``--out runs/results.jsonl`` in a
    fresh checkout), but a whole tree of missing folders is a mistyped path, refused naming the folder."""
    path = Path(path)
    folder = path.parent
    if not folder.exists() and not folder.parent.exists():
        raise FileNotFoundError(
            f"{flag} {path}: the folder {folder} does not exist, nor {folder.parent} above it; eval creates the "
            f"results file's own folder only: create {folder.parent} first or choose another {flag}"
        )
    return path  # a folder where no file can be created: refused up front as the run creates its lock file there
