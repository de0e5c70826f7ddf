"""The one store every command appends its records to: a JSON Lines file, resumable, locked, append-only.

Eval results (:mod:`reasonkv.eval.records`), bench results (:mod:`reasonkv.bench.store`) and calibrate's
labels and signals (:mod:`reasonkv.analysis.store`) are such files; each package keeps only what its
records mean. One JSON object per line; the first may be a header the caller gives (an eval's manifest).
A killed run leaves at worst one torn last line: it is skipped when read and cut off before the next
append; any other line that is not a JSON object is an error naming the file and the line. Each record is
written as one line and flushed at once; lines are never changed in place. Before every record and when it
closes, the store checks that its path still names the file it writes and that the file's size, first line
and last bytes are as it left them (a file moved, replaced or overwritten in place is an error naming it,
never a success), and a record that cannot be written whole is cut off again.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from reasonkv.runs.outputs import (
    OutputError,
    OutputLock,
    advice,
    create_exclusive,
    make_folder,
    names_file,
    reason,
    remove_stale_temps,
    where_now,
    write_atomic,
)

_HEAD = 1 << 20  # the most of a first line remembered (a run manifest is a few KiB)
_TAIL = 4096  # the last bytes remembered

__all__ = [
    "JsonlStore",
    "compact_line",
    "iter_records",
    "json_safe",
    "numbered_lines",
    "numbered_records",
    "read_records",
]


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that strict JSON holds as it is: a float that is not finite becomes ``None`` (read
    back as ``nan`` by ``numpy.asarray(values, dtype=float)``), numbers plain ints and floats, mappings dicts
    with string keys, tuples lists, any other object its ``str``."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def compact_line(record: Mapping[str, Any]) -> str:
    """``record`` as one line of strict JSON (see :func:`json_safe`) without spaces."""
    return json.dumps(json_safe(record), allow_nan=False, separators=(",", ":"))


def numbered_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes, dict[str, Any] | None, str | None]]:
    """``(line number, line, record, problem)`` for every line of ``path`` (if it exists) but blank ones and a
    torn tail (a last line without its newline that is not JSON); ``record`` is None for a line that is not a
    JSON object, with ``problem`` saying why."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                # Decoded here: json.loads on bytes guesses the encoding, and names UTF-16 for binary junk.
                record = json.loads(line.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                if not line.endswith(b"\n"):
                    return  # the tail of an interrupted write (only the last line can lack its newline)
                yield number, line, None, _not_json(error)
                continue
            if not isinstance(record, dict):
                yield number, line, None, f"expected a JSON object, got {type(record).__name__}"
                continue
            yield number, line, record, None


def _not_json(error: ValueError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"not a JSON record (not UTF-8 text: byte 0x{error.object[error.start]:02x} at column {error.start + 1})"
    return f"not a JSON record ({error})"


def numbered_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every complete record of ``path`` (:func:`numbered_lines`); any other line
    that is not a JSON object raises ``ValueError`` naming the file and the line."""
    for number, _, record, problem in numbered_lines(path):
        if record is None:
            raise ValueError(f"{path}, line {number}: {problem}")
        yield number, record


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The complete records of ``path``, one at a time (see :func:`numbered_records`)."""
    return (record for _, record in numbered_records(path))


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of ``path`` (``[]`` when it does not exist; see :func:`numbered_records`)."""
    return list(iter_records(path))


class JsonlStore:
    """The JSON Lines file one process appends to (its folder created if needed), its lock held until
    :meth:`close`: read the records already there with :meth:`records`, then :meth:`start` and :meth:`append`.

    ``lock``: what this writer does (``eval``, ``merge``, ...), for which the store takes the file's lock; or the
    lock the caller holds that covers the file; or ``None`` (a claimed folder's lock covers it). A lock the store
    knows is checked with the file. ``encode``: a record's line (:func:`compact_line`); ``fsync``: also force
    each record to disk; ``counts``: which lines are records in messages (an eval's manifest is not).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lock: str | OutputLock | None = None,
        encode: Callable[[Mapping[str, Any]], str] = compact_line,
        fsync: bool = False,
        counts: Callable[[Mapping[str, Any]], bool] | None = None,
    ):
        self.path = Path(path)
        self.encode = encode
        self.fsync = fsync
        self._counts = counts or (lambda record: True)
        self._covering = lock if isinstance(lock, OutputLock) else None  # held by the caller
        if self._covering is not None:
            self._covering.check_in_place()  # its folder is still there: never re-create it elsewhere
        make_folder(self.path.parent, str(self.path))
        self._lock = OutputLock(self.path, lock).acquire() if isinstance(lock, str) else None
        self._fd: int | None = None  # the file this store writes, once started
        self._end = 0  # the file's size as this store left it
        self._head = b""  # its first line, as read or written
        self._tail = b""  # its last bytes (up to _TAIL) before _end
        self._started = False
        self._unsynced = False
        self._closed = False
        self.counted = 0  # records this store wrote (see ``counts``)

    def records(self) -> Iterator[dict[str, Any]]:
        """The complete records already in the file (see :func:`iter_records`)."""
        return iter_records(self.path)

    def start(self, header: Mapping[str, Any] | None = None) -> bool:
        """Make the file ready for appending; returns whether this created it (holding ``header``, complete or
        not at all; without one the first :meth:`append` creates it). An existing file loses a torn last line,
        and a complete last record that only lacks its newline gets it."""
        self._check_open()
        if self._started:
            return False
        self._started = True
        remove_stale_temps(self.path)
        if self.path.exists():
            self._open(create=False)
            self._mend_tail()
            self._snapshot()  # as mended
            return False
        if header is None:
            return False
        self.check_in_place()
        create_exclusive(self.path, self._line(header))
        self._open(create=False)
        return True

    def append(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``record`` as one line and flush it; returns the record as it reads back."""
        self.start()
        line = self._line(record)
        self.check_in_place()
        if self._fd is None:
            self._open(create=True)  # a store without a header: the first record creates the file
        self._write(line, "appending a record")
        self.counted += bool(self._counts(record))
        self._unsynced = not self.fsync
        return json.loads(line)

    def rewrite(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Replace the file by one holding just ``records`` (the owner drops the others), whole or not at all."""
        self._check_open()
        write_atomic(self.path, "".join(self.encode(r) + "\n" for r in records))
        self._started = True
        self._close_file()
        self._open(create=False)

    def discard(self) -> None:
        """Delete the file (the owner cannot use its records); the next :meth:`append` begins a new one."""
        self._check_open()
        self._close_file()
        self.path.unlink(missing_ok=True)
        self._started = True

    def check_in_place(self) -> None:
        """Raise :class:`OutputError` when the path no longer names the file this store writes, the lock
        guarding it no longer names the lock file held (its folder was moved), or the file's content is
        not what this store left there (it was overwritten in place)."""
        if self._fd is None or names_file(self.path, self._fd):
            for lock in (self._lock, self._covering):
                if lock is not None:
                    lock.check_in_place()
            self._check_content()
            return
        now = where_now(self._fd)
        replaced = self.path.exists()
        if now:
            where = f"it is now {now}" + (", and another file took its place" if replaced else "")
        else:
            where = "another file took its place; the file written was deleted" if replaced else "it was deleted"
        what = "move it back and rerun the same command to resume" if now else "rerun the same command"
        raise OutputError(
            f"{self.path} was removed, renamed or replaced while this process wrote to it ({where}): nothing more "
            f"is written, and the {self.counted} records written since it started are not at {self.path}; "
            f"{what}"
        )

    def _check_content(self) -> None:
        """Raise :class:`OutputError` when the open file's size, first line or last bytes are not as left."""
        if self._fd is None:
            return
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, len(self._head), 0) if size == self._end else b""
            tail = os.pread(self._fd, len(self._tail), self._end - len(self._tail)) if size == self._end else b""
        except OSError as error:
            raise self._failed("reading it back", error) from error
        if size != self._end:
            change = f"its size is {size:,} bytes, not the {self._end:,} this process left"
        elif head != self._head:
            change = "its first line is no longer the one this process read or wrote"
        elif tail != self._tail:
            change = "its last line is no longer the one this process read or wrote"
        else:
            return
        raise OutputError(
            f"{self.path} was overwritten while this process wrote to it ({change}): nothing more is written, and "
            f"the {self.counted} records written since it started may be gone from it; find what wrote over it, "
            "then rerun the same command: it resumes from what the file holds"
        )

    def close(self, *, check: bool = True) -> None:
        """Force what was appended to disk, check the file is still in place, and release the lock.

        ``check=False`` (closing after another error): no checks, just let go of the file and the lock.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if check and self._fd is not None:
                if self._unsynced:
                    try:
                        os.fsync(self._fd)
                    except OSError as error:
                        raise self._failed("forcing the records to disk", error) from error
                self.check_in_place()
        finally:
            self._close_file()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> JsonlStore:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(check=kind is None)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path} was closed: open a new store to write to it")

    def _line(self, record: Mapping[str, Any]) -> bytes:
        return (self.encode(record) + "\n").encode("utf-8")

    def _open(self, *, create: bool) -> None:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)  # read: to check it is as left
        try:
            self._fd = os.open(self.path, flags, 0o666)
        except OSError as error:
            raise self._failed("opening it to append", error) from error
        self._snapshot()

    def _snapshot(self) -> None:
        """Remember the open file's size, first line and last bytes (what :meth:`_check_content` compares)."""
        try:
            self._end = os.fstat(self._fd).st_size
            first = os.pread(self._fd, min(self._end, _HEAD), 0)
            self._head = first[: first.index(b"\n") + 1] if b"\n" in first else first
            start = max(0, self._end - _TAIL)
            self._tail = os.pread(self._fd, self._end - start, start)
        except OSError as error:
            raise self._failed("reading it", error) from error

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _write(self, data: bytes, step: str) -> None:
        """Append ``data`` whole, or cut the file back to where it was and raise naming the step."""
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # no torn line for the next reader or writer
            raise self._failed(step, error) from error
        if size == 0 or (not self._head.endswith(b"\n") and len(self._head) < _HEAD):
            self._snapshot()  # the file's first line was (being) written now
        else:
            self._end = size + len(data)
            self._tail = (self._tail + data)[-_TAIL:]

    def _failed(self, step: str, error: OSError) -> OutputError:
        try:
            safe = sum(1 for record in iter_records(self.path) if self._counts(record))
            kept = f"the {safe} complete records in it are safe"
        except (OSError, ValueError):
            kept = "the complete records in it are safe"
        return OutputError(f"{self.path}: {step} failed ({reason(error)}); {kept}; {advice(error)}")

    def _mend_tail(self) -> None:
        try:
            with open(self.path, "r+b") as handle:
                size = handle.seek(0, os.SEEK_END)
                tail = b""
                while len(tail) < size and b"\n" not in tail:  # read back to the last newline
                    step = min(1 << 20, size - len(tail))
                    handle.seek(size - len(tail) - step)
                    tail = handle.read(step) + tail
                if not tail or tail.endswith(b"\n"):
                    return
                cut = tail.rfind(b"\n") + 1
                try:
                    json.loads(tail[cut:])
                except (json.JSONDecodeError, UnicodeDecodeError):
                    handle.truncate(size - len(tail) + cut)  # the torn line of an interrupted write
                    return
            self._write(b"\n", "ending its last record")  # a complete record that only lacks its newline
        except OutputError:
            raise
        except OSError as error:
            raise self._failed("cutting off the torn line an interrupted run left", error) from error
