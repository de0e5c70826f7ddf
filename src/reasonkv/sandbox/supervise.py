"""Run one sandbox process to its end: read its output up to a cap, kill it at a deadline.

The process is started in a session of its own; killing it means ``SIGKILL`` to that whole process
group. Inside bubblewrap that is enough for the whole tree (the sandbox's PID namespace dies with its
first process); without bubblewrap a child that left the group survives, which the sandbox reports.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Finished", "supervise"]

# After a kill, how long to wait for the pipes to close before giving up on them.
_DRAIN_SECONDS = 2.0
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Finished:
    """How the process ended."""

    returncode: int | None  # None: it could not be reaped (it was killed and abandoned)
    stdout: bytes
    stderr: bytes
    timed_out: bool  # killed at the deadline
    over_limit: bool  # killed for writing more than the output cap
    seconds: float


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
    user: int | None = None,
    group: int | None = None,
    kill_first: Callable[[], None] | None = None,
) -> Finished:
    """Start ``argv`` with ``stdin_fd`` as its standard input and watch it until it ends.

    Standard output and error are read as they come; each keeps at most ``output_limit`` bytes, and a
    process that writes more is killed. At ``timeout`` seconds after the start it is killed too.
    ``user``/``group``: run as that uid/gid (the caller must be root), with no supplementary groups.
    ``kill_first``: called before the process group is killed (to kill what lies beyond it first).
    """
    start = time.monotonic()
    identity = {} if user is None else {"user": user, "group": group, "extra_groups": []}
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
    timed_out = over_limit = False
    deadline = start + timeout
    try:
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out or over_limit:
                        break  # killed, yet the pipes stay open past the drain time: give up on them
                    timed_out = True
                    _kill(process, kill_first)
                    deadline = time.monotonic() + _DRAIN_SECONDS
                    continue
                for key, _ in selector.select(remaining):
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
                    if len(chunk) > room and not (timed_out or over_limit):
                        over_limit = True
                        _kill(process, kill_first)
                        deadline = time.monotonic() + _DRAIN_SECONDS
        if not (timed_out or over_limit):
            # Both pipes are closed, but a program that closed them may still be running.
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
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
        timed_out=timed_out,
        over_limit=over_limit,
        seconds=time.monotonic() - start,
    )
