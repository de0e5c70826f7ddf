"""What the commands write: only their own outputs, one writer at a time.

Two rules hold for every ``--out`` (``eval``, ``report``, ``bench``, ``calibrate``):

**Ownership.** Nothing is written before the output is recognised as this tool's own, and anything else
is refused with an error and left exactly as it was.

- A results file (``eval --out``) is recognised by its first line, the run manifest (see
  :mod:`reasonkv.eval.records`).
- A folder (``report``, ``bench``, ``calibrate``) is recognised by its marker file ``.reasonkv.json``,
  which names the command that writes there and every file name the command owns in it. A folder
  without a marker is claimed when none of the files the command writes is there yet (a new or
  unrelated folder), or when it holds that command's own output from before markers existed (each
  command says how it recognises it). Other files may share the folder: they are never overwritten
  or deleted; a command that would write to the name of one refuses instead.
- An input is never an output: a command refuses an ``--out`` that would write over one of its inputs.

**One writer.** A writer holds an exclusive advisory lock (``flock``) on ``<file>.lock`` (a results
file) or ``<folder>/.reasonkv.lock`` for its whole run; the lock file records its pid and host. A
second writer fails at once with a message naming the output and that pid. The kernel drops the lock
of a killed process, so a stale lock file never blocks a resume; a writer removes its lock file when
it finishes. The output must live on a filesystem with working ``flock`` (local disks, NFSv4).

**Whole files.** A file written in one go is complete or absent, never half-written:
:func:`create_exclusive` makes a new one, :func:`write_atomic` replaces one of the command's own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "FOLDER_LOCK",
    "MARKER",
    "ClaimedFolder",
    "OutputLock",
    "OutputLocked",
    "claim_folder",
    "create_exclusive",
    "lock_path",
    "refuse_inputs",
    "write_atomic",
]

MARKER = ".reasonkv.json"
FOLDER_LOCK = ".reasonkv.lock"
_TOOL = "reasonkv"


class OutputLocked(ValueError):
    """Another process holds the lock of an output."""


def lock_path(target: str | os.PathLike[str]) -> Path:
    """The lock file of a results file (``<file>.lock``) or of a folder (``<folder>/.reasonkv.lock``)."""
    target = Path(target)
    return target / FOLDER_LOCK if target.is_dir() else target.with_name(target.name + ".lock")


def _read_holder(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names, ``{}`` when it is empty, ``None`` when it is not one of ours."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip():
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) and holder.get("tool") == _TOOL else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process"
    what = f"pid {holder.get('pid', '?')}"
    if holder.get("host") and holder.get("host") != socket.gethostname():
        what += f" on {holder['host']}"
    if holder.get("purpose"):
        what += f" (reasonkv {holder['purpose']}"
        what += f", since {holder['since']})" if holder.get("since") else ")"
    return what


class OutputLock:
    """An exclusive ``flock`` on the lock file of ``target``, held until :meth:`release`.

    Parameters
    ----------
    target
        The output (a results file or a folder); the lock file is :func:`lock_path` of it.
    purpose
        What the holder does (``eval``, ``merge``, ``bench``, ...): shown to whoever is refused.
    wait_for
        Holders with one of these purposes are short-lived (a merge, the start of a sharded run):
        :meth:`acquire` waits for them, up to ``timeout`` seconds. Any other holder is refused at once.
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        purpose: str,
        *,
        wait_for: Iterable[str] = ("merge", "admission"),
        timeout: float = 600.0,
        path: str | os.PathLike[str] | None = None,
    ):
        self.target = Path(target)
        self.path = Path(path) if path is not None else lock_path(self.target)
        self.purpose = purpose
        self.wait_for = tuple(wait_for)
        self.timeout = timeout
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock; raises :class:`OutputLocked` naming the holder when another process has it."""
        deadline = time.monotonic() + self.timeout
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = _read_holder(self.path)
                if holder and holder.get("purpose") in self.wait_for and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                raise OutputLocked(
                    f"{self.target} is in use by {_describe(holder)}: wait for it to finish, or write to "
                    f"another --out (the lock is {self.path})"
                ) from None
            # A releasing holder unlinks the file while holding it: make sure this is still the file the path names.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if _read_holder(self.path) is None:
                os.close(fd)
                raise ValueError(f"{self.path} is not a reasonkv lock file: move it away or use another --out")
            holder = {
                "tool": _TOOL,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "purpose": self.purpose,
                "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            self._fd = fd
            return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (a no-op when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def holder(path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Who holds the lock file ``path`` now (``None`` when nobody does); leaves the file as it is."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return _read_holder(Path(path)) or {}
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    @staticmethod
    def describe(holder: dict[str, Any] | None) -> str:
        """``pid 123 (reasonkv eval, since ...)``: a holder as :meth:`holder` returns it, for messages."""
        return _describe(holder)


@contextlib.contextmanager
def _complete_copy(path: Path, data: bytes) -> Iterator[str]:
    """A temporary file next to ``path`` holding ``data``, on disk, with the usual permissions; removed after."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def create_exclusive(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data``, complete or not at all; ``FileExistsError`` if it exists.

    The data goes to a temporary file first, which is then linked to ``path`` (a link never replaces a
    file): a run killed meanwhile leaves no half-written output that would later look foreign.
    """
    with _complete_copy(path, data) as tmp:
        os.link(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` (this command's own file) by one holding ``text``: readers see the old or the new, whole."""
    with _complete_copy(path, text.encode("utf-8")) as tmp:
        os.replace(tmp, path)


def refuse_inputs(outputs: Iterable[str | os.PathLike[str]], inputs: Iterable[str | os.PathLike[str]]) -> None:
    """Raise ``ValueError`` when a path about to be written is one of the command's inputs."""
    written = [Path(p) for p in outputs]
    for source in inputs:
        source = Path(source)
        if not source.exists():
            continue
        for target in written:
            if target.exists() and os.path.samefile(source, target):
                raise ValueError(f"--out would write over the input {source}: an input is never an output")


# ---------------------------------------------------------------------------------- folders


class ClaimedFolder:
    """An output folder this process owns and has locked; release with :meth:`release` (or ``with``)."""

    def __init__(self, path: Path, command: str, lock: OutputLock):
        self.path = path
        self.command = command
        self._lock = lock

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ClaimedFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _owned_names(
    folder: Path, command: str, names: Iterable[str], recognise: Callable[[Path], bool] | None
) -> list[str]:
    """The names of ``folder`` the command owns after this claim; raises when the folder is not its own."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} exists and is not a folder")
    names = list(dict.fromkeys(names))
    marker = folder / MARKER
    owned: list[str] = []
    if marker.exists():
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("tool") != _TOOL or not isinstance(data.get("files"), list):
            raise ValueError(f"{marker} is not a reasonkv marker file: move it away or use another --out")
        if data.get("command") != command:
            raise ValueError(
                f"--out {folder} holds the output of `reasonkv {data.get('command')}`, not of `reasonkv {command}`: "
                "use another --out"
            )
        owned = [str(n) for n in data["files"]]
    elif folder.is_dir():
        present = [n for n in names if (folder / n).exists()]
        if present and (recognise is None or not recognise(folder)):
            raise ValueError(
                f"{folder / present[0]} exists and was not written by `reasonkv {command}`: "
                "nothing was changed; move it away or use another --out"
            )
        owned = present  # the command's own output from before markers existed
    for name in names:
        if (folder / name).exists() and name not in owned:
            raise ValueError(
                f"{folder / name} exists and was not written by `reasonkv {command}`: "
                "nothing was changed; move it away or use another --out"
            )
    return list(dict.fromkeys([*owned, *names]))


def claim_folder(
    folder: str | os.PathLike[str],
    command: str,
    names: Iterable[str],
    *,
    recognise: Callable[[Path], bool] | None = None,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> ClaimedFolder:
    """Make sure ``folder`` is this command's own, lock it, and record that it owns ``names`` there.

    Parameters
    ----------
    folder
        The ``--out`` folder; created when missing.
    command
        ``report``, ``bench`` or ``calibrate``: a folder belongs to one command.
    names
        Every file name (in the folder itself) the command may write during this run.
    recognise
        For a folder without a marker that already holds some of ``names``: whether it is the command's
        own output from before markers existed (then those files are adopted).
    inputs
        The command's input files: none of them may be one of the files written.

    Raises
    ------
    ValueError
        The folder, a file in it or the lock is not the tool's (nothing is changed), or an input would
        be overwritten.
    OutputLocked
        Another process writes to the folder.
    """
    folder = Path(folder)
    names = list(names)
    refuse_inputs([folder / n for n in [*names, MARKER]], inputs)
    _owned_names(folder, command, names, recognise)  # refuse before creating anything
    folder.mkdir(parents=True, exist_ok=True)
    lock = OutputLock(folder, command, path=folder / FOLDER_LOCK).acquire()
    try:
        owned = _owned_names(folder, command, names, recognise)  # again, now that nobody else can write
        marker = {"tool": _TOOL, "command": command, "files": sorted(owned)}
        tmp = folder / f".{MARKER}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, folder / MARKER)
    except BaseException:
        lock.release()
        raise
    return ClaimedFolder(folder, command, lock)
