"""Which failures are the user's to fix, and the one line that tells them how.

A user error (a bad value, a missing or unwritable file, a corrupt model, a package that is not
installed, not enough memory) is reported as one line; anything else is a bug in reasonkv and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re

from reasonkv.runs.oom import is_out_of_memory

# Raised for what the user gave or has: bad values, paths, files, hub ids, installs.
USER_ERRORS = (ValueError, OSError, ImportError, MemoryError)

# Options that decide how much memory a command needs: (attribute, what to lower), in the order to try.
MEMORY_KNOBS = (
    ("batch_size", "--batch-size"),
    ("batch_sizes", "--batch-sizes"),
    ("prompt", "the number of prompts"),
    ("max_new_tokens", "--max-new-tokens"),
    ("lengths", "--lengths"),
    ("cached", "--cached"),
    ("max_trace_tokens", "--max-trace-tokens"),
)


def user_message(error: BaseException, args: argparse.Namespace) -> str | None:
    """The one line to print for ``error``, or ``None`` if it is a bug (whose traceback should show)."""
    if is_out_of_memory(error):
        return memory_message(error, args)
    package = (getattr(error, "name", None) or "").split(".")[0] if isinstance(error, ImportError) else ""
    if package == "reasonkv":
        return None  # one of our own modules failing to import is a bug or a broken install: keep the traceback
    if isinstance(error, ModuleNotFoundError) and package:
        return f"the Python package {package!r} is not installed ({one_line(error)})"
    return one_line(error) if isinstance(error, USER_ERRORS) else None


def one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


def memory_message(error: BaseException, args: argparse.Namespace) -> str:
    """``out of memory (tried to allocate 2.9 GiB); lower --batch-size or ..., or use --dtype bf16 ...``."""
    text = str(error)
    detail = ""
    if match := re.search(r"allocate (\d+) bytes", text):
        detail = f" (tried to allocate {int(match.group(1)) / 2**30:.1f} GiB)"
    elif match := re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]iB)", text):
        detail = f" (tried to allocate {match.group(1)})"
    lower = [knob for attr, knob in MEMORY_KNOBS if getattr(args, attr, None) is not None]
    full = str(getattr(args, "dtype", "")).lower() in ("fp32", "float32")
    other = [use for use, fits in (("--dtype bf16", full), ("a smaller --model", hasattr(args, "model"))) if fits]
    advice = [f"{verb} {' or '.join(knobs)}" for verb, knobs in (("lower", lower), ("use", other)) if knobs]
    return f"out of memory{detail}" + (f"; {', or '.join(advice)}" if advice else "")


def missing_requirements() -> list[str]:
    """The declared dependencies of reasonkv that are not installed, as requirement strings.

    Empty when reasonkv itself is not installed (a source checkout on ``sys.path``).
    """
    try:
        requirements = importlib.metadata.requires("reasonkv") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        if ";" in requirement:
            continue  # extras and environment markers: not needed by every install
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
        if name is None:
            continue
        try:
            importlib.metadata.distribution(name.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(requirement.strip())
    return missing
