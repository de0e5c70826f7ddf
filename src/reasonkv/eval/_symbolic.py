"""Symbolic equivalence through math-verify, with a hard time bound, callable from any thread.

math-verify bounds its own work with ``signal.alarm``, which only works in the main thread and
cannot interrupt a long C-level computation (say, an integer power with a huge exponent). So
the check runs in one long-lived child process (``_symbolic_worker.py``): the caller waits at
most ``timeout_s`` and, past it, the child is killed and the answer counts as not equivalent.
The child starts on first use (about a second, importing sympy) and is restarted after a kill.
Calls from several threads are served one at a time. Needs a POSIX system (``select`` on pipes).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

__all__ = ["STARTUP_TIMEOUT_S", "shutdown", "symbolic_equal"]

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
_WORKER_SCRIPT = Path(__file__).with_name("_symbolic_worker.py")


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(_WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self.pid_owner = os.getpid()
        self._buffer = b""
        if self._readline(STARTUP_TIMEOUT_S) != b"ready":
            self.kill()
            raise RuntimeError(f"math-verify worker failed to start ({sys.executable} {_WORKER_SCRIPT})")

    def ask(self, pred: str, gold: str, timeout_s: float) -> bool | None:
        """The worker's verdict, or ``None`` if it did not answer in time (it is then killed)."""
        inner = max(1, int(timeout_s / 3))  # parse gold, parse pred, verify
        query = json.dumps({"pred": pred, "gold": gold, "timeout": inner}) + "\n"
        self.proc.stdin.write(query.encode("utf-8"))
        self.proc.stdin.flush()
        line = self._readline(timeout_s)
        if line is None:
            self.kill()
            return None
        return bool(json.loads(line)["ok"])

    def _readline(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:  # the worker died
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def alive(self) -> bool:
        return self.proc.poll() is None and self.pid_owner == os.getpid()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_lock = threading.Lock()
_worker: _Worker | None = None


def _ask(pred: str, gold: str, timeout_s: float) -> bool:
    global _worker
    with _lock:
        for attempt in range(2):
            if _worker is None or not _worker.alive():
                # After a fork the child must not share the parent's pipes: start its own worker.
                _worker = _Worker()
            try:
                verdict = _worker.ask(pred, gold, timeout_s)
            except (BrokenPipeError, OSError, ValueError):
                _worker.kill()
                _worker = None
                if attempt:
                    raise
                continue
            if verdict is None:
                _worker = None
                logger.warning("math-verify gave no answer within %.1f s; counted as not equivalent", timeout_s)
                return False
            return verdict


@lru_cache(maxsize=16384)
def symbolic_equal(pred: str, gold: str, timeout_s: float = 10.0) -> bool:
    """Whether math-verify finds ``pred`` equivalent to ``gold`` (LaTeX or plain expressions, wrapped in
    ``$...$``) within ``timeout_s`` seconds (the worker's one-off start aside); False also when parsing fails."""
    return _ask(f"${pred}$", f"${gold}$", timeout_s)


def shutdown() -> None:
    """Stop the worker process (it is restarted on the next call)."""
    global _worker
    with _lock:
        if _worker is not None and _worker.pid_owner == os.getpid():
            _worker.kill()
        _worker = None


atexit.register(shutdown)
