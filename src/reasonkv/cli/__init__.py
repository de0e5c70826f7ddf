"""The ``reasonkv`` command line: the only package that reads command-line arguments."""

from __future__ import annotations

from reasonkv.cli.main import main

__all__ = ["main"]
