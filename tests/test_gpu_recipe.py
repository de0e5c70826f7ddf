"""The GPU recipe starts on the GPU machine as is: a bare copy of the repository (no .venv), run from
src/, with torch and transformers but no gguf, no math-verify and no plotting; 12 result files (and
each folder's ownership marker, and the inductor cache's folder).

CI runs this file on the oldest supported transformers (5.17, what the GPU machines have) too. The
recipe's SMOKE=1 mode runs its exact commands on the tiny shape on the CPU; SMOKE=gpu (part 1 alone, in
two rounds) is run here on the tiny shape too. Its parts' time limits fit 9 minutes as its header says.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reasonkv.runs.outputs import MARKER

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_gpu.sh"
ABSENT = ("gguf", "math_verify", "matplotlib")  # not on the GPU machine (matplotlib is, but plots are off)


def _default(name: str) -> int:
    match = re.search(rf'^{name}="\$\{{{name}:-(\d+)\}}"$', SCRIPT.read_text(), re.MULTILINE)
    assert match, f"{name} has no numeric default in the recipe"
    return int(match.group(1))


def test_the_parts_time_limits_fit_nine_minutes_as_the_header_says():
    text = SCRIPT.read_text()
    limits = {name: _default(name) for name in ("COMPILE_SECONDS", "LENGTHS_SECONDS", "BATCH_SECONDS", "TIER_SECONDS")}
    assert sum(limits.values()) <= 9 * 60, limits
    # the header's arithmetic ends each part on its limit, in the order the parts run
    assert [int(n) for n in re.findall(r"\(limit (\d+)\)", text)[:4]] == list(limits.values())
    assert text.index("if wants compiled") < text.index("if wants lengths")  # compiled entries first
    assert "export TORCHINDUCTOR_FX_GRAPH_CACHE=1" in text and "inductor-cache" in text


def _run(repo: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/bench_gpu.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _results(out: Path) -> list[Path]:
    """Result files: not the folders' markers and locks, nor the compiled graphs' cache."""
    return [
        p
        for p in out.rglob("*")
        if p.is_file() and p.name != MARKER and p.suffix != ".lock" and "inductor-cache" not in p.parts
    ]


def _bare_copy(target: Path) -> None:
    for name in ("src", "scripts"):
        shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "pyproject.toml", target / "pyproject.toml")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
@pytest.mark.slow
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
    done = _run(repo, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== goals" in done.stdout
    # per part: bench.json, bench.md, results.jsonl (besides the folder's marker and its lock, kept for reruns)
    files = _results(out)
    assert len(files) <= 12, sorted(str(p.relative_to(out)) for p in files)
    assert not any(p.suffix == ".png" for p in files)

    assert done.stderr.index("== part 1: eager against compiled") < done.stderr.index("== part 2: step time")
    lengths = json.loads((out / "lengths" / "bench.json").read_text())
    policies = {r["policy"] for r in lengths["records"]}
    assert {"full", "transformers", "h2o", "tova"} <= policies
    # interleaved rounds, one group per run; one cache extended from the first length to the second
    records = lengths["records"]
    assert {r["rounds"] for r in records} == {2} and len({r["rounds_group"] for r in records}) == 1
    assert all(r["windows"][-1]["extended_from"] == r["windows"][0]["length"] for r in records)
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
    assert "compiled against eager" in done.stdout and "rounds" in done.stdout
    assert not (repo / ".venv").exists()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
@pytest.mark.slow
def test_the_gpu_smoke_runs_part_one_alone_in_two_rounds(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    _bare_copy(repo)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, SMOKE="gpu", OUT=str(out), OMP_NUM_THREADS="1")
    # its commands, on the tiny shape on the CPU
    env.update(MODEL="shape:tiny", DEVICE="cpu", BUDGET="48", BUFFER="16", DECODE_STEPS="16", PREFILL_CHUNK="128")
    env.update(COMPILE_LENGTH="96", COMPILE_BACKEND="aot_eager", BENCH_ARGS="--threads 1", COMPILE_SECONDS="400")
    done = _run(repo, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted({p.relative_to(out).parts[0] for p in _results(out)}) == ["compiled"]
    compiled = json.loads((out / "compiled" / "bench.json").read_text())
    assert {r["policy"] for r in compiled["records"]} == {
        p + suffix for p in ("full", "transformers", "streaming", "epikv") for suffix in ("", "~compiled")
    }
    assert {(r["batch"], r["rounds"]) for r in compiled["records"]} == {(1, 2)}

    env["SMOKE"] = "fast"
    refused = _run(repo, env)
    assert refused.returncode == 2 and "SMOKE must be 0, 1" in refused.stderr and "'fast'" in refused.stderr


def _window_evictions(record: dict) -> int:
    measured = record.get("measured") or record
    windows = measured.get("windows") or [measured]
    return max(int(w.get("evictions", 0)) for w in windows)
