"""``reasonkv bench``: speed and memory of every policy, side by side, written as it is measured.

Three measurements, combinable in one run (one model load):

- the length sweep (default; ``--lengths``): tokens/s, time per step, its split into forward /
  record / observe / score / gather, memory and cache slots at each length, per policy and batch
  size; ``--prefill-to-length`` reaches each length by a prefill instead of decoding every token;
- ``--eviction-cost --cached N``: the time of one eviction when the cache holds ``N`` tokens;
- ``--max-batch --memory-limit M --length L``: the largest batch each policy fits in ``M`` at
  ``L`` tokens, and the throughput measured at that batch.

``--quantized Q --bits b`` adds a quantized-tier variant of every requested evicting policy to the
length sweep, at the K/V bytes of the plain policy (:mod:`reasonkv.bench.tiers`).
``--allocation pyramid|adaptive|calibrated`` runs the length sweep's evicting entries under per-(layer,
kv-head) budgets and reports their K/V bytes per layer (:mod:`reasonkv.bench.layers`). A selection policy
(``quest``, ``seer``) is reported with the K/V bytes its decode steps read beside those it holds
(:mod:`reasonkv.bench.reads`).

Outputs in ``--out``: ``results.jsonl`` (one record per finished entry, appended as measured),
``bench.json`` (everything, with the command line, date, machine and versions), ``bench.md`` and
PNG plots. Rerunning with the same ``--out`` skips finished entries unless ``--force``. The folder
must be the bench's own (or new); it is locked while the bench runs (:func:`reasonkv.bench.store.claim_output`).

Every flag is declared once, as a field of :class:`~reasonkv.bench.settings.BenchSettings` (:mod:`reasonkv.runs.flags`);
this module adds them to the parser and reads them back; :func:`reasonkv.bench.run.run_bench` does the rest.
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
