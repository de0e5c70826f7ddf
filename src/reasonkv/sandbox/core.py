"""The sandbox: run one Python program in a fresh, isolated, limited process and say how it ended.

A probe (:func:`probe`) picks the mechanism once per process: ``bubblewrap`` (:mod:`reasonkv.sandbox.bubblewrap`:
namespaces of its own, every guarantee holds), or without it a plain ``process`` in a session of its own, which
lacks :data:`GUARANTEES` and refuses to run until each is allowed explicitly. Either way the program runs under
an unprivileged uid with an empty environment, limits (:mod:`reasonkv.sandbox.limits`), capped output streams
and a wall-clock kill; a result's ``status`` is one of :data:`STATUSES`. Through bubblewrap the memory limit
holds for the run as a whole, by a ``cgroup`` of its own (:mod:`reasonkv.sandbox.cgroup`) or the ``supervisor``'s
account (:mod:`reasonkv.sandbox.usage`); without it, per process. What each guarantee means: docs/sandbox.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from reasonkv.sandbox.bubblewrap import PROGRAM, TMPFS, TMPFS_MB, StatusPipe, bwrap_argv, init_process, namespaces
from reasonkv.sandbox.cgroup import RunGroup, find_parent
from reasonkv.sandbox.host import Setup, find_interpreter, sandbox_user
from reasonkv.sandbox.limits import Limits, check_memory, check_timeout, launcher_argv
from reasonkv.sandbox.supervise import Finished, supervise
from reasonkv.sandbox.usage import RunUsage
from reasonkv.suggest.integers import is_int

STATUSES = ("ok", "failed", "timeout", "memory", "output-limit", "killed")

#: What only namespaces guarantee: name -> (the mechanism that provides it, what fails without it).
GUARANTEES: dict[str, tuple[str, str]] = {
    "network": ("network-namespace", "the program can open network connections, local services included"),
    "process-tree": (
        "pid-namespace",
        "a child that calls setsid or double-forks survives the kill at the deadline",
    ),
    "filesystem": (
        "mount-namespace",
        "the program sees the machine's files and can write wherever its uid may (/tmp at least)",
    ),
}

#: Bytes kept of each output stream; a program that writes more is killed (status ``output-limit``).
OUTPUT_LIMIT = 16 * 2**20

_COMMON = ("unprivileged-uid", "rlimits", "empty-environment", "output-cap", "wall-clock-kill")
_PROCESS_ISOLATION = ("new-session", "fresh-temporary-cwd", *_COMMON, "memory-per-process")
_MEMORY = re.compile(r"^(?:MemoryError\b|Fatal Python error: .*memory)|Cannot allocate memory", re.M | re.I)
_PER_RUN = ("cpu_seconds", "memory_mb")  # set from each run's timeout and memory
_PATH_ONLY = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
_REFUSED_SECONDS = 1.0  # how long reading a starting sandbox's memory may be refused before that is an error


class SandboxUnavailable(OSError):
    """The sandbox cannot run here, or would lack a guarantee that was not allowed."""


@dataclass(frozen=True)
class RunResult:
    """How one program run ended."""

    status: str  # one of STATUSES
    returncode: int | None  # the exit status (through bubblewrap, 128 + N for signal N); None if never reaped
    stdout: str  # what the program wrote, at most the output limit (decoded as UTF-8)
    stderr: str
    isolation: tuple[str, ...]  # the mechanisms that were in force for this run
    seconds: float  # wall time of the run, sandbox set-up included


def _memfd(name: str, data: bytes) -> int:
    """An in-memory file holding ``data``, positioned at its start (nothing touches the disk)."""
    fd = os.memfd_create(name, 0)
    view, written = memoryview(data), 0
    while written < len(view):
        written += os.write(fd, view[written:])
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _result(finished: Finished, isolation: tuple[str, ...], oom: bool = False) -> RunResult:
    code = finished.returncode  # as the shell (and bubblewrap) has it: 128 + N for a process ended by signal N
    code = 128 - code if code is not None and code < 0 else code
    stderr = finished.stderr.decode("utf-8", "replace")
    stdout = finished.stdout.decode("utf-8", "replace")
    return RunResult(_status(finished, code, stderr, oom), code, stdout, stderr, isolation, finished.seconds)


def _status(finished: Finished, code: int | None, stderr: str, oom: bool) -> str:
    if finished.timed_out:
        return "timeout"
    if finished.over_limit:
        return "output-limit"
    if finished.over_memory or oom:
        return "memory"
    if code is None:
        return "killed"
    if code > 128:  # ended by a signal: its CPU-time limit, or killed
        return "timeout" if code - 128 == signal.SIGXCPU else "killed"
    if code != 0:
        return "memory" if _MEMORY.search(stderr[-4000:]) else "failed"
    return "ok"


def _kill_init(pid: int, namespace: int) -> None:
    """SIGKILL ``pid`` if it still is the init of the PID namespace ``namespace`` (a pid can be reused once
    its process is gone: the pidfd pins the process whose namespace was checked)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfds on this kernel: then bubblewrap's own kill must do)
        return
    try:
        if os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{namespace}]":
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _attach(init: tuple[int, int], deadline: float, alive) -> RunUsage | None:
    """The run's memory account, once bubblewrap has made the sandbox's root (None: bubblewrap ended, or the
    deadline came first)."""
    refused_until = time.monotonic() + _REFUSED_SECONDS
    while True:
        try:
            return RunUsage.attach(*init, TMPFS)
        except PermissionError as error:
            # Refused while bubblewrap changes its credentials; refused for longer, the account cannot be kept.
            if alive() and time.monotonic() >= refused_until:
                raise SandboxUnavailable(f"the supervisor cannot read the sandbox's memory use: {error}") from error
            if not alive():
                return None
        except OSError:
            if not alive() or time.monotonic() >= deadline:
                return None
        time.sleep(0.002)  # bubblewrap still sets up the sandbox's root


def _run_bubblewrap(setup: Setup, source: str, stdin: str, limits: Limits, timeout: float, cap: int) -> RunResult:
    python = setup.interpreter.path
    command = launcher_argv(python, limits, [python, "-I", PROGRAM])
    fds = {"program": _memfd("main.py", source.encode("utf-8")), "stdin": _memfd("stdin", stdin.encode("utf-8"))}
    fds["status"], fds["status_write"] = os.pipe()
    fds["gate"], fds["gate_write"] = os.pipe()
    status = StatusPipe(fds["status"])
    group: RunGroup | None = None
    usage: RunUsage | None = None

    def close(name: str) -> None:
        fd = fds.pop(name, -1)
        if fd >= 0:
            os.close(fd)

    def started(process) -> None:
        # bubblewrap waits on the gate with the sandbox made and the program not yet started: put the
        # sandbox under its memory limit, then open the gate.
        nonlocal usage
        close("gate")
        alive = lambda: process.poll() is None  # noqa: E731
        deadline = time.monotonic() + timeout
        init = status.wait_for_init(deadline, alive)
        if init is not None:
            if group is not None:
                group.add(init[0])  # its children, the program among them, are born in the group
            else:
                usage = _attach(init, deadline, alive)
                if usage is None:
                    return  # bubblewrap ended, or the deadline passed: the gate stays shut
        with contextlib.suppress(BrokenPipeError):  # bubblewrap ended before its program started
            os.write(fds["gate_write"], b"x")
        close("gate_write")

    def over_memory() -> bool:
        return usage is not None and usage.bytes() > limits.memory_mb * 2**20

    def kill_namespace() -> None:
        # The sandbox's first process is its PID namespace's init: killing it ends every process in the
        # namespace, and bubblewrap, its parent, then reaps it and exits (no orphan is left to the host).
        status.read_available()
        init = init_process(status.text)
        if init is not None:
            _kill_init(*init)

    oom = False
    try:
        if setup.cgroup is not None:
            group = RunGroup.create(Path(setup.cgroup), memory_mb=limits.memory_mb, processes=limits.processes + 2)
        finished = supervise(
            bwrap_argv(setup, fds["program"], fds["status_write"], fds["gate"], command),
            stdin_fd=fds["stdin"],
            timeout=timeout,
            output_limit=cap,
            pass_fds=(fds["program"], fds["status_write"], fds["gate"]),
            user=setup.user,
            kill_first=kill_namespace,
            started=started,
            watch=None if group is not None else over_memory,
        )
        close("status_write")
        status.read_available()  # bubblewrap has exited: its status is complete
        oom = group is not None and group.oom_killed()
    finally:
        for name in list(fds):
            close(name)
        if usage is not None:
            usage.close()
        if group is not None:
            group.remove()
    started_, spaces = namespaces(status.text)
    if not started_ and not finished.timed_out:
        stderr = finished.stderr.decode("utf-8", "replace").strip()[-500:]
        raise SandboxUnavailable(f"bubblewrap could not start the program: {stderr or 'no message'}")
    isolation = ("bubblewrap", "user-namespace", *spaces, *(["no-nested-user-namespaces"] * setup.disable_userns))
    isolation += ("read-only-system", f"fresh-tmpfs-cwd:{TMPFS_MB}MiB", "capped-dev-shm", *_COMMON)
    isolation += (f"memory-per-run:{'cgroup' if group is not None else 'supervisor'}",)
    return _result(finished, isolation, oom)


def _run_process(setup: Setup, source: str, stdin: str, limits: Limits, timeout: float, cap: int) -> RunResult:
    python = setup.interpreter.path
    root = Path(tempfile.mkdtemp(prefix="reasonkv-sandbox-"))
    try:
        program = root / "main.py"
        program.write_text(source, encoding="utf-8")
        work = root / "work"
        work.mkdir()
        os.chmod(program, 0o444)
        os.chmod(root, 0o755)
        if setup.user.switch:
            os.chown(work, setup.user.uid, setup.user.gid)
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            finished = supervise(
                launcher_argv(python, limits, [python, "-I", str(program)]),
                stdin_fd=stdin_file.fileno(),
                timeout=timeout,
                output_limit=cap,
                cwd=str(work),
                env=dict(_PATH_ONLY),
                user=setup.user,
            )
    finally:
        _remove_tree(root)
    return _result(finished, _PROCESS_ISOLATION)


def _remove_tree(root: Path) -> None:
    def unlock(function, path, _error) -> None:  # a folder the program made unreadable
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            function(path)

    shutil.rmtree(root, onerror=unlock)


_PROBE_PROGRAM = "import os\nprint(os.getuid())\n"
_PROBES: dict[tuple[str | None, str | None], Setup] = {}
_PROBE_LOCK = threading.Lock()


def probe(bwrap: str | None = "bwrap", python: str | None = None) -> Setup:
    """Find how programs can be isolated here (once per process and arguments).

    ``bwrap``: the bubblewrap executable (None: do not use it); ``python``: the interpreter to run
    programs with (default: the running one when the sandbox's user can read it, else the system's).
    """
    key = (bwrap, python)
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = _probe(bwrap, python)
        return _PROBES[key]


def _probe(bwrap: str | None, python: str | None) -> Setup:
    user = sandbox_user()
    interpreter, why = find_interpreter(user, python)
    if interpreter is None:
        return Setup("none", (), tuple(GUARANTEES), why, user, None)
    process = Setup("process", _PROCESS_ISOLATION, tuple(GUARANTEES), "", user, interpreter)
    if bwrap is None:
        return replace(process, reason="bubblewrap was not asked for")
    path = shutil.which(bwrap)
    if path is None:
        return replace(process, reason=f"bubblewrap ({bwrap}) is not installed (apt-get install bubblewrap)")
    candidate = Setup("bubblewrap", (), (), "", user, interpreter, bwrap=path, memory_limit="supervisor")
    for disable in (True, False):  # bubblewrap before 0.8 has no --disable-userns
        candidate = replace(candidate, disable_userns=disable)
        result, failure = _probe_run(candidate)
        if result is None:
            continue
        missing = tuple(name for name, (needs, _) in GUARANTEES.items() if needs not in result.isolation)
        return _with_cgroup(replace(candidate, isolation=result.isolation, missing=missing))
    return replace(process, reason=f"bubblewrap cannot isolate programs here ({failure})")


def _probe_run(candidate: Setup) -> tuple[RunResult | None, str]:
    """The probe program's result through ``candidate``, or ``(None, why it failed)``."""
    try:
        result = _run_bubblewrap(candidate, _PROBE_PROGRAM, "", Limits.for_run(30, 256), 30, 4096)
    except (SandboxUnavailable, OSError) as error:  # OSError: bwrap cannot even be started
        return None, str(error)
    if result.status != "ok" or result.stdout.strip() != str(candidate.user.uid):
        return None, f"the test program ended with {result.status}: {result.stderr.strip()[-300:]}"
    return result, ""


def _with_cgroup(setup: Setup) -> Setup:
    """``setup`` with its runs in cgroups of their own where one works here, else why not."""
    try:
        parent, why = find_parent()
    except OSError as error:
        parent, why = None, f"the cgroups of this process cannot be read ({error})"
    if parent is None:
        return replace(setup, memory_reason=why)
    trial = replace(setup, memory_limit="cgroup", cgroup=str(parent))
    result, failure = _probe_run(trial)
    if result is None:
        return replace(setup, memory_reason=f"a run in a cgroup under {parent} failed ({failure})")
    return replace(trial, isolation=result.isolation)


class Sandbox:
    """Runs programs with the isolation :func:`probe` (``bwrap``, ``python``) found; refuses while a guarantee is
    missing and not among ``allow_missing`` (names of :data:`GUARANTEES`). ``output_limit``: the bytes kept of each
    output stream."""

    def __init__(
        self,
        *,
        allow_missing: Iterable[str] = (),
        output_limit: int = OUTPUT_LIMIT,
        bwrap: str | None = "bwrap",
        python: str | None = None,
    ):
        allowed = tuple(sorted(set(allow_missing)))
        unknown = [name for name in allowed if name not in GUARANTEES]
        if unknown:
            raise ValueError(f"unknown sandbox guarantee {', '.join(unknown)}; known: {', '.join(GUARANTEES)}")
        if not is_int(output_limit) or output_limit < 1024:
            raise ValueError(f"output_limit must be an integer >= 1024 bytes, got {output_limit!r}")
        self.allow_missing = allowed
        self.output_limit = output_limit
        self.bwrap = bwrap
        self.python = python

    @property
    def setup(self) -> Setup:
        return probe(self.bwrap, self.python)

    def check(self) -> Setup:
        """The setup, if programs may run with it; else :class:`SandboxUnavailable` naming what is missing."""
        setup = self.setup
        if setup.interpreter is None:
            raise SandboxUnavailable(f"the sandbox cannot run programs here: {setup.reason}")
        refused = [name for name in setup.missing if name not in self.allow_missing]
        if refused:
            lost = "; ".join(f"{name}: {GUARANTEES[name][1]}" for name in refused)
            raise SandboxUnavailable(
                f"the sandbox cannot guarantee {', '.join(refused)} here ({setup.reason}): {lost}. Allow each "
                f"explicitly to run anyway (reasonkv eval --sandbox-allow-missing {','.join(refused)})"
            )
        return setup

    def describe(self) -> dict[str, Any]:
        """What the sandbox runs with, for a run manifest."""
        setup = self.setup
        return {
            "mechanism": setup.mechanism,
            "isolation": list(setup.isolation),
            "missing": list(setup.missing),
            "allowed_missing": list(self.allow_missing),
            "reason": setup.reason or None,
            "uid": setup.user.uid,
            "python": None if setup.interpreter is None else setup.interpreter.version,
            "output_limit": self.output_limit,
            "limits": {k: v for k, v in asdict(Limits.for_run(1, 64)).items() if k not in _PER_RUN},
            "tmpfs_mb": TMPFS_MB if setup.mechanism == "bubblewrap" else None,
            "memory_limit": setup.memory_limit,
            "memory_limit_reason": setup.memory_reason or None,
        }

    def run(self, source: str, stdin: str = "", timeout: float = 10.0, memory_mb: int = 1024) -> RunResult:
        """Run ``source`` as a Python program with ``stdin`` as its standard input (see the module docstring)."""
        for name, value in (("source", source), ("stdin", stdin)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        timeout = check_timeout(timeout)
        check_memory(memory_mb)
        setup = self.check()
        run = _run_bubblewrap if setup.mechanism == "bubblewrap" else _run_process
        return run(setup, source, stdin, Limits.for_run(timeout, memory_mb), timeout, self.output_limit)
