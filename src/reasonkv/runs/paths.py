"""Paths as results and reports record them: never the machine's own layout.

Results and reports are read on other machines, so a path they name is relative to something the reader has:
a file of the reasonkv package as ``<reasonkv>/data/gsm8k.jsonl``; any other file relative to the folder of the
run or report that names it (the two keep working when moved together), except a file under the home directory
that the folder is not also under, as ``~/...``. A relative path is the user's own spelling and is kept. A
recorded command line is ``reasonkv <arguments>`` with its paths so, never the launcher or script.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PACKAGE_TAG", "command_line", "portable_argv", "portable_command", "portable_path"]

PACKAGE_TAG = "<reasonkv>"
_PACKAGE = Path(__file__).resolve().parents[1]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def portable_path(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> str:
    """``path`` as a results file or report in ``folder`` records it (see the module docstring)."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    resolved = Path(os.path.abspath(text))
    folder = Path(os.path.abspath(folder))
    if _inside(resolved, _PACKAGE):
        return f"{PACKAGE_TAG}/{resolved.relative_to(_PACKAGE).as_posix()}"
    home = Path(os.path.abspath(Path.home()))
    if _inside(resolved, home) and not _inside(folder, home):
        return "~" if resolved == home else f"~/{resolved.relative_to(home).as_posix()}"
    return Path(os.path.relpath(resolved, folder)).as_posix()


def portable_argv(argv: Sequence[str], folder: str | os.PathLike[str]) -> list[str]:
    """A command line with every absolute path in it (an argument, or the value of ``--name=/path``) made
    :func:`portable_path`."""
    out = []
    for argument in argv:
        name, equals, value = argument.partition("=")
        if equals and name.startswith("-") and os.path.isabs(value):
            out.append(f"{name}={portable_path(value, folder)}")
        elif os.path.isabs(argument):
            out.append(portable_path(argument, folder))
        else:
            out.append(argument)
    return out


def command_line(folder: str | os.PathLike[str], argv: Sequence[str] | None = None) -> list[str]:
    """``reasonkv <arguments>`` as this process was started (``sys.argv``; whatever the launcher, script or
    entry point), as a record in ``folder`` names it: every absolute path in it :func:`portable_path`."""
    argv = list(sys.argv if argv is None else argv)
    return ["reasonkv", *portable_argv(argv[1:], folder)]


def portable_command(command: str, folder: str | os.PathLike[str]) -> str:
    """A command spelled out as one shell line (a run's settings as flags), its paths as ``folder`` names them."""
    return shlex.join(portable_argv(shlex.split(command), folder))
