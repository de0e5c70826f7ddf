"""Run one sandbox process to its end: read its output up to a cap, watch its memory, kill it at a deadline.

The process is started in a session of its own; killing it means ``SIGKILL`` to that whole process
group. Inside bubblewrap that is enough for the whole tree (the sandbox's PID namespace dies with its
first process); without bubblewrap a child that left the group survives, which the sandbox reports.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reasonkv.sandbox.host import SandboxUser

__all__ = ["Finished", "supervise"]

# After a kill, how long to wait for the pipes to close before giving up on them.
_DRAIN_SECONDS = 2.0
_CHUNK = 1 << 16
#: How often the memory watch looks (seconds): a run can overshoot by what it allocates in this time.
WATCH_SECONDS = 0.025


@dataclass(frozen=True)
class Finished:
    """How the process ended."""

    returncode: int | None  # None: it could not be reaped (it was killed and abandoned)
    stdout: bytes
    stderr: bytes
    timed_out: bool  # killed at the deadline
    over_limit: bool  # killed for writing more than the output cap
    seconds: float
    over_memory: bool = False  # killed because the memory watch found it over its limit


def _kill(process: subprocess.Popen, before: Callable[[], None] | None) -> None:
    if before is not None:
        before()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # a group we cannot signal: at least the process itself
        process.kill()


def supervise(
    argv: Sequence[str],
    *,
    stdin_fd: int,
    timeout: float,
    output_limit: int,
    pass_fds: Sequence[int] = (),
    cwd: str = "/",
    env: dict[str, str] | None = None,
    user: SandboxUser | None = None,
    kill_first: Callable[[], None] | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
    watch: Callable[[], bool] | None = None,
) -> Finished:
    """Start ``argv`` with ``stdin_fd`` as its standard input and watch it until it ends.

    Standard output and error are read as they come; each keeps at most ``output_limit`` bytes, and a
    process that writes more is killed. At ``timeout`` seconds after the start it is killed too.
    ``user``: when it must be switched to, run as its uid/gid (the caller is root), with no supplementary groups.
    ``kill_first``: called before the process group is killed (to kill what lies beyond it first).
    ``started``: called with the process once it runs (an exception kills it and is raised).
    ``watch``: called every :data:`WATCH_SECONDS`; when it returns True the process is killed as over its
    memory.
    """
    start = time.monotonic()
    identity = {"user": user.uid, "group": user.gid, "extra_groups": []} if user is not None and user.switch else {}
    process = subprocess.Popen(
        list(argv),
        stdin=stdin_fd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        cwd=cwd,
        env={} if env is None else env,
        start_new_session=True,
        close_fds=True,
        **identity,
    )
    out, err = process.stdout.fileno(), process.stderr.fileno()
    buffers = {out: bytearray(), err: bytearray()}
    killed = ""  # why the process was killed: "timeout", "output" or "memory"
    deadline = start + timeout
    next_look = start

    def kill(why: str) -> None:
        nonlocal killed, deadline
        killed = why
        _kill(process, kill_first)
        deadline = time.monotonic() + _DRAIN_SECONDS

    def look() -> float:
        """Run the memory watch when it is due; the seconds until it is due again."""
        nonlocal next_look
        if watch is None or killed:
            return float("inf")
        now = time.monotonic()
        if now >= next_look:
            next_look = now + WATCH_SECONDS
            if watch():
                kill("memory")
                return float("inf")
        return next_look - now

    try:
        if started is not None:
            started(process)
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                until_look = look()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if killed:
                        break  # killed, yet the pipes stay open past the drain time: give up on them
                    kill("timeout")
                    continue
                for key, _ in selector.select(min(remaining, until_look)):
                    try:
                        chunk = os.read(key.fd, _CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffer = buffers[key.fd]
                    room = output_limit - len(buffer)
                    buffer += chunk[: max(room, 0)]
                    if len(chunk) > room and not killed:
                        kill("output")
        # Both pipes are closed, but a program that closed them may still be running (and allocating).
        while not killed and process.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=min(remaining, look()))
    finally:
        if process.poll() is None:
            _kill(process, kill_first)
        try:
            returncode: int | None = process.wait(timeout=_DRAIN_SECONDS)
        except subprocess.TimeoutExpired:
            returncode = None
        process.stdout.close()
        process.stderr.close()
    return Finished(
        returncode=returncode,
        stdout=bytes(buffers[out]),
        stderr=bytes(buffers[err]),
        timed_out=killed == "timeout",
        over_limit=killed == "output",
        seconds=time.monotonic() - start,
        over_memory=killed == "memory",
    )
