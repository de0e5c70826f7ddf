"""Committed docs are read on other machines: no file under ``docs/`` names the working directories of the
machine that wrote it (a home, a worktree, a temporary folder). Results, reports, benchmark records and the
commands in them name paths relative to the run or the checkout, or as ``<reasonkv>/...``."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
# an absolute path into a place that is one machine's own (not preceded by a name: docs/tmp/ is relative)
MACHINE_PATH = re.compile(rb"(?<![\w.~<>-])/(?:tmp|work|home|root|Users|mnt|scratch)/[\w.-]+")


def _machine_paths(path: Path) -> list[str]:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return sorted({m.group().decode(errors="replace") for m in MACHINE_PATH.finditer(data)})


def test_the_pattern_finds_a_machine_path_and_not_a_relative_one():
    assert MACHINE_PATH.search(b'"argv": ["/work/wt-x/src/reasonkv/cli.py"') is not None
    assert MACHINE_PATH.search(b"--out /tmp/b12/after-1") is not None
    assert MACHINE_PATH.search(b"--out docs/tmp/run <reasonkv>/data/gsm8k.jsonl ~/work/x") is None


def test_no_committed_doc_names_the_machine_it_was_written_on():
    found = {
        str(path.relative_to(DOCS.parent)): paths
        for path in sorted(DOCS.rglob("*"))
        if path.is_file() and (paths := _machine_paths(path))
    }
    assert not found, f"absolute machine paths (write them relative to the run, or <reasonkv>/...): {found}"
