"""What the sandbox needs from the machine: an interpreter the sandbox's user can read, and that user.

A program runs under an unprivileged user id: the caller's own when it is not root; when it is root,
``nobody`` (65534 where the name is unknown). A root caller's interpreter often lives under ``/root``
(pyenv, conda), which ``nobody`` cannot enter; then the system's ``python3`` runs the programs.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Interpreter", "SandboxUser", "Setup", "find_interpreter", "sandbox_user"]

_NOBODY = 65534


@dataclass(frozen=True)
class SandboxUser:
    """The uid/gid programs run as; ``switch``: the caller is root and must drop to them."""

    uid: int
    gid: int
    switch: bool


def sandbox_user() -> SandboxUser:
    if os.geteuid() != 0:
        return SandboxUser(os.geteuid(), os.getegid(), switch=False)
    try:
        entry = pwd.getpwnam("nobody")
        return SandboxUser(entry.pw_uid, entry.pw_gid, switch=True)
    except KeyError:
        return SandboxUser(_NOBODY, _NOBODY, switch=True)


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter and the folder tree it needs (``prefix``: its ``lib/pythonX.Y`` lives there)."""

    path: str
    prefix: str
    version: str


@dataclass(frozen=True)
class Setup:
    """What this machine offers, found once by :func:`reasonkv.sandbox.core.probe`."""

    mechanism: str  # "bubblewrap" | "process" | "none" (no interpreter the sandbox's user can run)
    isolation: tuple[str, ...]
    missing: tuple[str, ...]  # names of GUARANTEES that do not hold
    reason: str  # why bubblewrap is not used ("" when it is)
    user: SandboxUser
    interpreter: Interpreter | None
    bwrap: str | None = None
    disable_userns: bool = False
    memory_limit: str = "per-process"  # "cgroup" | "supervisor" (the run as a whole) | "per-process"
    cgroup: str | None = None  # the folder the run's groups are made in (memory_limit "cgroup")
    memory_reason: str = ""  # why no cgroup limits the run ("" when one does)


def _readable_by(path: Path, user: SandboxUser) -> bool:
    """Whether ``user`` can reach and read ``path`` (every folder above it searchable by them)."""
    if not user.switch:
        return os.access(path, os.R_OK | os.X_OK)
    try:
        for part in [*reversed(path.parents), path]:
            info = part.stat()
            bit = stat.S_IXUSR if info.st_uid == user.uid else stat.S_IXGRP if info.st_gid == user.gid else stat.S_IXOTH
            if not info.st_mode & bit:
                return False
    except OSError:
        return False
    return True


def _version(path: str) -> str | None:
    try:
        done = subprocess.run(
            [path, "-I", "-S", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=30,
            env={},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _candidates() -> list[Path]:
    """The running interpreter's base executable, then the system's ``python3``."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    others = [
        Path(os.path.realpath(name)) for name in (sys.executable, "/usr/bin/python3", shutil.which("python3")) if name
    ]
    return list(dict.fromkeys([base, *others] if base.exists() else others))


def find_interpreter(user: SandboxUser, path: str | None = None) -> tuple[Interpreter | None, str]:
    """An interpreter ``user`` can run, or ``(None, why)``. ``path``: that interpreter only."""
    candidates = [Path(os.path.realpath(path))] if path else _candidates()
    tried = []
    for candidate in candidates:
        if not candidate.is_file():
            tried.append(f"{candidate} (missing)")
        elif not _readable_by(candidate, user):
            tried.append(f"{candidate} (uid {user.uid} cannot reach it)")
        elif (version := _version(str(candidate))) is None:
            tried.append(f"{candidate} (does not run)")
        else:  # <prefix>/bin/python3.X
            return Interpreter(str(candidate), str(candidate.parent.parent), version), ""
    return None, "no Python interpreter the sandbox's user can run: tried " + ", ".join(tried)
