"""Works as installed: every package that reasonkv's code imports is one of its declared dependencies."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "reasonkv").rglob("*.py"))


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)) for r in project["dependencies"]}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file, wherever they sit (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"reasonkv", "__future__"}


def test_the_scan_sees_imports_inside_functions():
    # bench's plots import matplotlib inside a function: the import that failed after a whole run
    assert "matplotlib" in imported_modules(ROOT / "src" / "reasonkv" / "bench" / "plots.py")


def test_every_third_party_import_is_a_declared_dependency():
    declared = declared_dependencies()
    providers = importlib.metadata.packages_distributions()
    uncovered = {}
    for path in SOURCES:
        for module in imported_modules(path):
            distributions = {normalise(d) for d in providers.get(module, [])}
            if not distributions & declared:
                uncovered.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not uncovered, f"imported but not in [project].dependencies of pyproject.toml: {uncovered}"


def test_the_test_extra_adds_only_test_tools():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    assert set(extras) == {"test"}, "a command must not need an extra: make it a dependency instead"
    assert {normalise(r.split(">")[0].split("=")[0]) for r in extras["test"]} == {"pytest", "ruff", "selenium"}


def test_every_data_file_is_package_data():
    # A data file that no pattern names is left out of the installed package (the shape configs once moved).
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    patterns = setuptools["package-data"]["reasonkv"]
    package = ROOT / "src" / "reasonkv"
    data = [
        p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
    ]
    assert data, "no data files found"
    unlisted = [name for name in data if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    assert not unlisted, f"data files missing from [tool.setuptools.package-data] in pyproject.toml: {unlisted}"
