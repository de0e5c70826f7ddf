"""What the commands write: only their own outputs, one writer at a time, failures said in full.

The rules every ``--out`` follows (``eval``, ``report``, ``bench``, ``calibrate``) are in docs/eval-at-scale.md.
In short: nothing is written before the output is recognised as this tool's own (a results file by its first
line, the run manifest; a folder by its marker file :data:`MARKER`, :func:`claim_folder`), and an input is never
an output. A writer holds an exclusive ``flock`` (:class:`OutputLock`) for its whole run; whether to wait for a
lock is decided by its purpose, never by reading the file. Lock files are never deleted (that is what breaks
locks on network filesystems), so a lock whose path no longer names the file held means the folder was moved
(:meth:`OutputLock.check_in_place`). A file written in one go goes through a temporary file
(:func:`create_exclusive`, :func:`write_atomic`); a failed write raises :class:`OutputError` naming the file,
the step, what is safe and how to go on; a failed clean-up after the work is a warning (:func:`warn`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
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
    "OutputError",
    "OutputLock",
    "OutputLocked",
    "claim_folder",
    "create_exclusive",
    "lock_path",
    "make_folder",
    "names_file",
    "refuse_inputs",
    "remove_stale_temps",
    "warn",
    "where_now",
    "write_atomic",
]

MARKER = ".reasonkv.json"
FOLDER_LOCK = ".reasonkv.lock"
TEMP_TAG = ".reasonkv-tmp-"  # in the names of temporary files: .<name>.reasonkv-tmp-XXXXXXXX
_TOOL = "reasonkv"
_FULL = (errno.ENOSPC, errno.EDQUOT)


class OutputLocked(ValueError):
    """Another process holds the lock of an output."""


class OutputError(OSError):
    """An output could not be written: the message names the file, the step and what to do."""


def warn(message: str) -> None:
    """Tell the user about a failed clean-up after the work (the run itself succeeded)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def advice(error: OSError) -> str:
    """What to do about a failed write, by its cause."""
    if error.errno in _FULL:
        return "free some space, then rerun the same command: it resumes"
    return "fix the cause, then rerun the same command: it resumes"


def reason(error: OSError) -> str:
    """``No space left on device`` (the operating system's words, without the file name)."""
    return error.strerror or str(error)


def lock_path(target: str | os.PathLike[str]) -> Path:
    """The lock file of a results file (``<file>.lock``) or of a folder (``<folder>/.reasonkv.lock``)."""
    target = Path(target)
    return target / FOLDER_LOCK if target.is_dir() else target.with_name(target.name + ".lock")


def make_folder(folder: str | os.PathLike[str], argument: str) -> None:
    """Create ``folder`` and its parents, or raise :class:`OutputError` naming ``argument`` (``--out X``)."""
    folder = Path(folder)
    for existing in [folder, *folder.parents]:
        if existing.exists():
            if not existing.is_dir():
                raise OutputError(f"{argument}: {existing} is a file, not a folder")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{argument}: cannot create the folder {folder} ({reason(error)})") from error


def _parse_holder(text: str) -> dict[str, Any] | None:
    """The holder a lock file's text names, ``{}`` when it is empty, ``None`` when it is not one of ours."""
    if not text.strip():
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) and holder.get("tool") == _TOOL else None


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        return _parse_holder(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError):
        return None


class OutputLock:
    """An exclusive ``flock`` on one lock file (default: :func:`lock_path` of ``target``, the output it guards),
    held until :meth:`release`. ``purpose`` (``eval``, ``merge``, ...) goes to the holder record; ``wait``: the
    seconds to wait while another process holds it (0 for a writer's lock; a short step's longest otherwise).
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        purpose: str,
        *,
        path: str | os.PathLike[str] | None = None,
        wait: float = 0.0,
    ):
        self.target = Path(target)
        self.path = Path(path) if path is not None else lock_path(self.target)
        self.purpose = purpose
        self.wait = wait
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock; raises :class:`OutputLocked` naming the holder when another process keeps it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise OutputError(
                f"cannot create the lock file {self.path} of {self.target} ({reason(error)}): write --out to a "
                "folder where this user can create files"
            ) from error
        try:
            self._lock(fd)
            held = _parse_holder(os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace"))
            if held is None:
                raise ValueError(f"{self.path} is not a reasonkv lock file: move it away or use another --out")
            self._record(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _lock(self, fd: int) -> None:
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                waited = f" (waited {self.wait:.0f} s)" if self.wait else ""
                raise OutputLocked(
                    f"{self.target} is in use by {self.describe(self._holder_now())}{waited}: wait for it to finish, "
                    f"or write to another --out (the lock is {self.path})"
                )
            time.sleep(0.1)

    def _holder_now(self) -> dict[str, Any] | None:
        """The record of the process that holds the lock (it writes it right after taking the lock)."""
        for _ in range(10):
            holder = _read_holder(self.path)
            if holder != {}:
                return holder
            time.sleep(0.1)
        return {}

    def _record(self, fd: int) -> None:
        """Write this holder's record and force it to disk (for messages only: a full disk does not stop us)."""
        holder = {
            "tool": _TOOL,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "purpose": self.purpose,
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            os.fsync(fd)

    def check_in_place(self) -> None:
        """Raise :class:`OutputError` when the lock file's path no longer names the file this lock holds: lock
        files are never deleted, so the output's folder was moved, and writing there now would be unguarded."""
        if self._fd is None or names_file(self.path, self._fd):
            return
        now = where_now(self._fd)
        where = f"the lock {self.path} is now {now}" if now else f"the lock {self.path} was deleted"
        if not now and self.path.exists():
            where = f"another file took the place of the lock {self.path}; the lock held was deleted"
        what = "move the folder back and rerun the same command to resume" if now else "rerun the same command"
        raise OutputError(
            f"{self.target}: its folder was removed, renamed or replaced while this process held its lock ({where}): "
            f"nothing more is written to it; {what}"
        )

    def release(self) -> None:
        """Drop the lock (a no-op when not held). The lock file stays; its holder record is cleared."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock

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
        if not holder:
            return "another process"
        what = f"pid {holder.get('pid', '?')}"
        if holder.get("host") and holder.get("host") != socket.gethostname():
            what += f" on {holder['host']}"
        if holder.get("purpose"):
            what += f" (reasonkv {holder['purpose']}"
            what += f", since {holder['since']})" if holder.get("since") else ")"
        return what


def names_file(path: Path, fd: int) -> bool:
    """Whether ``path`` names the open file ``fd`` now."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except OSError:
        return False


def where_now(fd: int) -> str | None:
    """Where the open file ``fd`` is now (Linux: ``/proc/self/fd``), or None when it was deleted or unknown."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return None if target.endswith(" (deleted)") else target


@contextlib.contextmanager
def _complete_copy(path: Path, data: bytes) -> Iterator[str]:
    """A temporary file next to ``path`` holding ``data``, on disk, with the usual permissions; removed after."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TEMP_TAG}", dir=path.parent)
    except OSError as error:
        message = f"{path}: cannot create a file in {path.parent} ({reason(error)}); {advice(error)}"
        raise OutputError(message) from error
    try:
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        except OSError as error:
            message = f"{path}: writing it failed ({reason(error)}); nothing was changed; {advice(error)}"
            raise OutputError(message) from error
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def remove_stale_temps(path: str | os.PathLike[str]) -> None:
    """Remove the temporary files of ``path`` that a killed writer left (call it holding ``path``'s lock); one
    that cannot be removed is a warning."""
    path = Path(path)
    try:
        stale = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}{TEMP_TAG}")]
    except OSError:
        return
    for tmp in stale:
        try:
            tmp.unlink(missing_ok=True)
        except OSError as error:
            warn(f"could not remove {tmp}, a temporary file a killed run left ({reason(error)}); it is harmless")


def create_exclusive(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data``, complete or not at all; ``FileExistsError`` if it exists (a temporary
    file linked to ``path``: a link never replaces a file, and a killed run leaves no half-written output)."""
    with _complete_copy(path, data) as tmp:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as error:
            raise OutputError(f"{path}: cannot create it ({reason(error)}); {advice(error)}") from error


def write_atomic(path: Path, text: str | bytes) -> None:
    """Replace ``path`` (this command's own file) by one holding ``text`` (or bytes): readers see the old or the
    new, whole."""
    with _complete_copy(path, text if isinstance(text, bytes) else text.encode("utf-8")) as tmp:
        try:
            os.replace(tmp, path)
        except OSError as error:
            message = f"{path}: cannot replace it ({reason(error)}); it is unchanged; {advice(error)}"
            raise OutputError(message) from error


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


class ClaimedFolder(OutputLock):
    """The lock of an output folder (``target``) this process owns, held once :func:`claim_folder` returns it:
    release it with :meth:`release` (or ``with``)."""

    def __enter__(self) -> ClaimedFolder:
        return self  # held already


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
        if present and recognise is not None and recognise(folder):
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
    """Make sure the ``--out`` ``folder`` (created when missing) is ``command``'s own, lock it, and record that
    the command owns ``names`` (every file name it may write there this run).

    ``recognise``: for a folder without a marker that already holds some of ``names``, whether it is the
    command's own output from before markers existed (then those files are adopted). ``inputs``: the command's
    input files, none of which may be written. Raises ``ValueError`` when the folder, a file in it or the lock is
    not the tool's, or an input would be overwritten (nothing is changed), :class:`OutputLocked` when another
    process writes to the folder.
    """
    folder = Path(folder)
    names = list(names)
    refuse_inputs([folder / n for n in [*names, MARKER]], inputs)
    _owned_names(folder, command, names, recognise)  # refuse before creating anything
    make_folder(folder, f"--out {folder}")
    lock = ClaimedFolder(folder, command, path=folder / FOLDER_LOCK)
    lock.acquire()
    try:
        owned = _owned_names(folder, command, names, recognise)  # again, now that nobody else can write
        for name in [*owned, MARKER]:
            remove_stale_temps(folder / name)
        marker = {"tool": _TOOL, "command": command, "files": sorted(owned)}
        write_atomic(folder / MARKER, json.dumps(marker, indent=1) + "\n")
    except BaseException:
        lock.release()
        raise
    return lock
