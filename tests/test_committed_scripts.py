"""The scripts committed beside the package (``scripts/``, the runnable files under ``docs/``) import only
names the package still has: a rename in ``src/`` that leaves one of them behind fails here, not when a
reader runs it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("docs/**/*.py")])


def _imported(path: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every ``from reasonkv... import name`` and ``(module, None)`` for every
    ``import reasonkv...`` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "reasonkv":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "reasonkv"]
    return found


def test_there_are_scripts_to_check():
    assert any(p.parent.name == "scripts" for p in SCRIPTS) and any("docs" in p.parts for p in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reasonkv_name_a_script_imports_exists(path):
    missing = []
    for module_name, name in _imported(path):
        module = importlib.import_module(module_name)
        if name is None or hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"{path.relative_to(ROOT)} imports names the package no longer has: {missing}"
