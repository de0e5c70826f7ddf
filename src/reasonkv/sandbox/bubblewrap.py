"""The bubblewrap command line of one run, and what a finished run's status says was isolated.

Every run gets new namespaces (``--unshare-all``, the user namespace required), a read-only root of its own,
fresh ``/proc`` and read-only ``/dev``, size-capped tmpfs, the program read-only at :data:`PROGRAM`, an empty
environment but ``PATH``, a new session, and death with its parent (docs/sandbox.md). bubblewrap writes the
namespaces it made to a status pipe, read back by :func:`namespaces` so that every result names what was really
in force; it then waits on a gate (``--block-fd``), so the caller can put the sandbox under its memory limit
before the program's first instruction.
"""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Callable
from pathlib import Path

from reasonkv.sandbox.host import Interpreter, Setup

__all__ = ["PROGRAM", "TMPFS", "TMPFS_MB", "WORKDIR", "StatusPipe", "bwrap_argv", "init_process", "namespaces"]

#: Where the program lives inside the sandbox (read-only), and its working directory (a fresh tmpfs).
PROGRAM = "/prog/main.py"
WORKDIR = "/work"
#: The sandbox's writable folders, each a tmpfs of :data:`TMPFS_MB` (bubblewrap's ``/dev`` tmpfs has no size
#: option: a capped ``/dev/shm`` is mounted on it and the rest made read-only).
TMPFS = (WORKDIR, "/tmp", "/dev/shm")
#: Size of each of the sandbox's tmpfs, in MiB.
TMPFS_MB = 64

# Top-level entries that are links into /usr on merged-/usr systems, or folders of their own elsewhere.
_SYSTEM_ROOTS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# bubblewrap's status key of each namespace -> its name in a result (in the order results list them).
_LONG = {"net": "network", "mnt": "mount"}
_STATUS_NAMES = {
    f"{k}-namespace": f"{_LONG.get(k, k)}-namespace" for k in ("pid", "net", "mnt", "ipc", "uts", "cgroup")
}


def _system_mounts(interpreter: Interpreter) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_ROOTS:
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    prefix = Path(interpreter.prefix)
    if prefix != Path("/usr") and Path("/usr") not in prefix.parents:
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


def bwrap_argv(setup: Setup, program_fd: int, status_fd: int, gate_fd: int, command: list[str]) -> list[str]:
    """The ``bwrap`` command of ``setup`` that runs ``command`` (the launcher and the program) in a fresh sandbox,
    once a byte can be read from ``gate_fd``."""
    size = str(TMPFS_MB * 2**20)
    tmpfs = [arg for folder in TMPFS for arg in ("--size", size, "--tmpfs", folder)]
    return [
        setup.bwrap,
        *("--unshare-all", "--unshare-user", *(["--disable-userns"] if setup.disable_userns else [])),
        *("--uid", str(setup.user.uid), "--gid", str(setup.user.gid), "--hostname", "sandbox"),
        *("--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"),
        *_system_mounts(setup.interpreter),
        *("--proc", "/proc", "--dev", "/dev", *tmpfs, "--remount-ro", "/dev"),
        *("--ro-bind-data", str(program_fd), PROGRAM),
        *("--json-status-fd", str(status_fd), "--block-fd", str(gate_fd)),
        *("--chdir", WORKDIR, "--remount-ro", "/", "--", *command),
    ]


def _documents(status: str) -> dict:
    """bubblewrap's status output (JSON documents one after another) merged into one dict."""
    decoder = json.JSONDecoder()
    found: dict = {}
    text, position = status.strip(), 0
    while position < len(text):
        try:
            document, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        if isinstance(document, dict):
            found.update(document)
        position = len(text) - len(text[end:].lstrip())
    return found


def init_process(status: str) -> tuple[int, int] | None:
    """``(pid, namespace)``: the host pid of the sandbox's first process (its PID namespace's init) and that
    namespace's inode, once bubblewrap started it."""
    found = _documents(status)
    pid, namespace = found.get("child-pid"), found.get("pid-namespace")
    if isinstance(pid, int) and pid > 0 and isinstance(namespace, int):
        return pid, namespace
    return None


def namespaces(status: str) -> tuple[bool, tuple[str, ...]]:
    """``(started, namespaces)`` from bubblewrap's status output: whether the program was started, and
    the namespaces (besides the user namespace, which ``--unshare-user`` makes a condition of starting)."""
    found = _documents(status)
    names = tuple(name for key, name in _STATUS_NAMES.items() if key in found)
    return "child-pid" in found, names


class StatusPipe:
    """The read end of bubblewrap's status pipe, and everything read from it so far."""

    def __init__(self, fd: int):
        self.fd = fd
        self._chunks: list[bytes] = []

    @property
    def text(self) -> str:
        return b"".join(self._chunks).decode("utf-8", "replace")

    def read_available(self) -> bool:
        """Read what is there without waiting; False once bubblewrap closed its end."""
        os.set_blocking(self.fd, False)
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self._chunks.append(chunk)

    def wait_for_init(self, deadline: float, alive: Callable[[], bool]) -> tuple[int, int] | None:
        """:func:`init_process` once bubblewrap reports it; None if bubblewrap closes the pipe or exits first,
        or at ``deadline`` (a ``time.monotonic()`` value)."""
        while True:
            open_ = self.read_available()
            init = init_process(self.text)
            if init is not None or not open_ or not alive():
                return init
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            select.select([self.fd], [], [], min(remaining, 0.05))
