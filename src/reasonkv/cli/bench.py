"""``reasonkv bench``: speed and memory of every policy, side by side, written as it is measured.

Three measurements, combinable in one run (one model load): the length sweep (default; ``--lengths``),
``--eviction-cost --cached N`` and ``--max-batch --memory-limit M --length L``; the outputs are listed in
docs/cli.md. Every flag is a field of :class:`~reasonkv.bench.settings.BenchSettings`: this module adds them
to the parser and reads them back; :func:`reasonkv.bench.run.run_bench` does the rest.
"""

from __future__ import annotations

import argparse

from reasonkv.bench.run import run_bench
from reasonkv.bench.settings import BenchSettings
from reasonkv.cli.flags import add_flags, read_flags

__all__ = ["add_arguments", "run", "settings_from"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, BenchSettings)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The settings the arguments describe (``ValueError`` for anything wrong, before any folder is touched)."""
    return BenchSettings(**read_flags(BenchSettings, args))


def run(args: argparse.Namespace) -> int:
    return run_bench(settings_from(args))
