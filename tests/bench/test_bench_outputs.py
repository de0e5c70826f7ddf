"""``reasonkv bench --out``: only its own folder, one bench at a time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reasonkv.bench.store import ResultStore
from reasonkv.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--no-plots", "--policies", "streaming"]
TINY += ["--lengths", "48", "--budget", "16", "--buffer", "8", "--prompt-length", "16", "--rounds", "1"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["results.jsonl", "bench.md", "memory.png"])
def test_a_file_the_bench_did_not_write_is_never_touched(tmp_path, capsys, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_text("somebody else's\n", encoding="utf-8")
    assert main([*TINY, "--out", str(out)]) == 2
    assert f"{out / name} exists and was not written by `reasonkv bench`" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [name]
    assert (out / name).read_text(encoding="utf-8") == "somebody else's\n"


def test_a_bench_folder_from_before_markers_is_resumed_and_a_running_bench_locks_its_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out)]) == 0
    (out / ".reasonkv.json").unlink()  # as written before markers existed
    assert main([*TINY, "--out", str(out)]) == 0
    assert "already in" in capsys.readouterr().err
    hold = "import sys, time; from reasonkv.runs.outputs import OutputLock; "
    hold += "OutputLock(sys.argv[1], 'bench', path=sys.argv[1] + '/.reasonkv.lock').acquire(); "
    hold += "print('held', flush=True); time.sleep(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", hold, str(out)], env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline().strip() == b"held"
        before = (out / "results.jsonl").read_bytes()
        assert main([*TINY, "--force", "--out", str(out)]) == 2
        assert f"{out} is in use by pid {child.pid} (reasonkv bench" in capsys.readouterr().err
        assert (out / "results.jsonl").read_bytes() == before
    finally:
        child.kill()
        child.wait(timeout=30)
    assert json.loads((out / ".reasonkv.json").read_text())["command"] == "bench"


def test_a_resumed_results_file_loses_its_torn_line_not_the_next_record(tmp_path):
    out = tmp_path / "run"
    store = ResultStore(out)
    first = store.add({"mode": "sweep", "policy": "full", "batch": 1, "status": "ok", "tokens_per_s": math.inf})
    assert first["tokens_per_s"] is None  # JSON has no inf
    with (out / "results.jsonl").open("a", encoding="utf-8") as handle:
        handle.write('{"mode": "sweep", "policy": "streaming", "ba')  # killed while writing it
    resumed = ResultStore(out)
    assert resumed.records == [first]
    resumed.add({"mode": "sweep", "policy": "streaming", "batch": 1, "status": "ok"})
    assert [r["policy"] for r in ResultStore(out).records] == ["full", "streaming"]
    with (out / "results.jsonl").open("a", encoding="utf-8") as handle:
        handle.write("not a record\n")
        handle.write(json.dumps(first) + "\n")
    with pytest.raises(ValueError, match=r"results\.jsonl, line 3: not a JSON record"):
        ResultStore(out)
