"""Whether a model's files are intact: a GGUF file's structure, readable checkpoint files, finite weights, and
the files of a copy reasonkv wrote itself. A damaged file is reported as such, never loaded into a model that
generates blank text; finite garbage loads without error, so only a hash of the file as written tells it apart.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from reasonkv.runs.digest import file_sha256 as _sha256

__all__ = [
    "CorruptModelError",
    "check_finite",
    "check_gguf_header",
    "copy_damage",
    "file_digests",
    "gguf_damage",
    "is_corrupt_file_error",
]

GGUF_MAGIC = b"GGUF"
_GGUF_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


class CorruptModelError(ValueError):
    """A model file is truncated or damaged, or its weights hold NaN or inf values."""


def is_corrupt_file_error(error: BaseException) -> bool:
    """Whether a loader's exception means a file it read is truncated or damaged."""
    kinds: tuple[type[BaseException], ...] = (
        CorruptModelError,
        json.JSONDecodeError,
        UnicodeDecodeError,
        pickle.UnpicklingError,
        EOFError,
    )
    try:
        from safetensors import SafetensorError

        kinds += (SafetensorError,)
    except ImportError:
        pass
    return isinstance(error, kinds)


def check_gguf_header(path: Path) -> None:
    """Refuse (:class:`CorruptModelError`) a file that does not start like a GGUF file, with its magic bytes and
    a whole header holding tensors (cheap: reads 24 bytes)."""
    with open(path, "rb") as file:
        head = file.read(_GGUF_HEADER.size)
    if not head.startswith(GGUF_MAGIC[: len(head)]) or not head:
        raise CorruptModelError(f"{str(path)!r} is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    if len(head) < _GGUF_HEADER.size:
        raise CorruptModelError(f"GGUF file {str(path)!r} is truncated: {len(head)} bytes, shorter than its header")
    _, version, tensors, _ = _GGUF_HEADER.unpack(head)
    if tensors == 0:
        raise CorruptModelError(f"GGUF file {str(path)!r} holds no tensors (format version {version})")


def gguf_damage(path: Path) -> str | None:
    """What is wrong with a GGUF file's structure, or ``None`` if every tensor lies inside the file (reads the
    whole header and tensor table, so it takes seconds: for diagnosing a failed load)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader fails in many ways on a damaged file; all mean "unreadable"
        return f"its header or tensor table cannot be read ({type(error).__name__}: {error})"
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        return f"its tensors need {end} bytes but the file has {size}"
    return None


def check_finite(model: torch.nn.Module, source: str) -> None:
    """Refuse a model whose floating-point weights hold NaN or inf (about one sum per tensor):
    :class:`CorruptModelError` naming ``source`` and the first damaged tensors."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.device.type != "meta"]
    if not named:
        return
    with torch.no_grad():
        # A sum is NaN or inf when an element is; summing in the weights' own dtype is many times faster
        # than an element-wise test. Only an fp16 sum may overflow on healthy weights: such a tensor is
        # then tested element by element.
        sums = torch.stack([p.sum().float().to(named[0][1].device) for _, p in named])
        suspects = [i for i, finite in enumerate(torch.isfinite(sums).tolist()) if not finite]
        bad = [named[i][0] for i in suspects if not bool(torch.isfinite(named[i][1]).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CorruptModelError(
            f"{source} is corrupt: {len(bad)} of {len(named)} weight tensors hold NaN or inf values ({shown})"
        )


def _stat(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


def file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """``name -> {"bytes", "mtime_ns", "ctime_ns", "sha256"}`` of every file in ``directory`` (not its subfolders)."""
    return {
        path.name: {**_stat(path), "sha256": _sha256(path)} for path in sorted(directory.iterdir()) if path.is_file()
    }


def copy_damage(
    directory: Path, digests: Mapping[str, Mapping[str, Any]]
) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """What is wrong with the files of ``directory`` against the :func:`file_digests` taken when they were written.

    A file whose size, modification and status-change times are as recorded is taken as it was (one ``stat``);
    any other is hashed again (about 1 s for SmolLM2's 538 MB). A program cannot set ``ctime`` back, so a file
    rewritten in place with its old modification time is still hashed and found; a bit flipped on the disk, which
    changes no time, is not (a weight turned NaN or inf still is, by :func:`check_finite`).

    Returns ``(damage, digests)``: the first damaged or missing file (None: all intact), and the digests to keep
    (with the new times of files found intact by their hash).
    """
    kept = {name: dict(known) for name, known in digests.items()}
    for name, known in digests.items():
        path = directory / name
        try:
            now = _stat(path)
        except OSError as error:
            return f"{name} is missing or unreadable ({error.strerror or error})", kept
        if now["bytes"] != known.get("bytes"):
            return f"{name} holds {now['bytes']} bytes, not the {known.get('bytes')} written", kept
        if now["mtime_ns"] == known.get("mtime_ns") and now["ctime_ns"] == known.get("ctime_ns"):
            continue
        try:
            digest = _sha256(path)
        except OSError as error:
            return f"{name} is unreadable ({error.strerror or error})", kept
        if digest != known.get("sha256"):
            return f"{name} was changed after it was written (its SHA-256 is not the one recorded then)", kept
        kept[name].update(mtime_ns=now["mtime_ns"], ctime_ns=now["ctime_ns"])  # touched, not changed: cheap again
    return None, kept
