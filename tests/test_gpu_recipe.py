"""The GPU recipe starts on the GPU machine as is: a bare copy of the repository (no .venv), run from
src/, with torch and transformers but no gguf, no math-verify and no plotting; 12 result files (and
each folder's ownership marker).

CI runs this file on the oldest supported transformers (5.17, what the GPU machines have) too. The
recipe's SMOKE mode runs its exact commands on the tiny shape on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reasonkv.runs.outputs import MARKER

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("gguf", "math_verify", "matplotlib")  # not on the GPU machine (matplotlib is, but plots are off)


def _bare_copy(target: Path) -> None:
    for name in ("src", "scripts"):
        shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "pyproject.toml", target / "pyproject.toml")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_the_recipe_runs_on_a_bare_copy_without_optional_packages(tmp_path):
    repo, out, blocker = tmp_path / "repo", tmp_path / "out", tmp_path / "blocker"
    _bare_copy(repo)
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT), encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # python3 = this test's interpreter
        PYTHONPATH=str(blocker),
        SMOKE="1",
        OUT=str(out),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        ["bash", "scripts/bench_gpu.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== goals" in done.stdout
    # per part: bench.json, bench.md, results.jsonl (besides the folder's marker and its lock, kept for reruns)
    files = [p for p in out.rglob("*") if p.is_file() and p.name != MARKER and p.suffix != ".lock"]
    assert len(files) <= 12, sorted(str(p.relative_to(out)) for p in files)
    assert not any(p.suffix == ".png" for p in files)

    lengths = json.loads((out / "lengths" / "bench.json").read_text())
    policies = {r["policy"] for r in lengths["records"]}
    assert {"full", "transformers", "h2o", "tova"} <= policies
    batches = json.loads((out / "max-batch" / "bench.json").read_text())
    evicting = [r for r in batches["records"] if r["policy"] != "full"]
    assert evicting and all(_window_evictions(r) >= 1 for r in evicting), "part 2's timed window holds no eviction"
    tier = json.loads((out / "tier" / "bench.json").read_text())
    assert any(r.get("tier") for r in tier["records"]), "part 3 measured no tiered cache"
    compiled = json.loads((out / "compiled" / "bench.json").read_text())
    entries = {(r["policy"], r["batch"]) for r in compiled["records"]}
    wanted = {"full", "streaming", "transformers"}
    assert {(p + suffix, b) for p in wanted for suffix in ("", "~compiled") for b in (1, 2)} <= entries
    assert set(compiled["summary"]["compiled"]) == {"1", "2"}, "part 4 compared no compiled entry with its eager one"
    assert "compiled against eager" in done.stdout
    assert not (repo / ".venv").exists()


def _window_evictions(record: dict) -> int:
    measured = record.get("measured") or record
    windows = measured.get("windows") or [measured]
    return max(int(w.get("evictions", 0)) for w in windows)
