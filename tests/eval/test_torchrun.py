"""``torchrun -m reasonkv eval``: processes on CPU give the records of one process; a killed rank resumes
with another number of processes. Each test launches torchrun (marked ``torchrun``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tiny_checkpoint import save_tiny_checkpoint

from reasonkv.eval.records import unit_key
from reasonkv.eval.runner import run_grid
from reasonkv.eval.shards import shard_files
from reasonkv.runs.store import read_records

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

pytestmark = [pytest.mark.torchrun, pytest.mark.usefixtures("one_torch_thread")]


def torchrun(processes: int, *args: str, entry: list[str] | None = None, env: dict | None = None):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]  # a free port: tests may overlap
    command += entry or ["-m", "reasonkv"]
    environment = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*command, *args], env=environment, capture_output=True, text=True, timeout=600)


def _units(path) -> dict[tuple, dict]:
    records = [r for r in read_records(path) if r["kind"] != "manifest"]
    counts = Counter(unit_key(r) for r in records)
    assert max(counts.values()) == 1, "a unit was recorded twice"
    return {unit_key(r): r for r in records}


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, r in got.items():
        w = want[key]
        if r["kind"] == "generation":
            fields = ("output_ids", "output_text", "extracted_answer", "correct", "seed", "evictions")
            assert {f: r[f] for f in fields} == {f: w[f] for f in fields}
        else:  # the same replay, batched differently: equal up to float rounding
            assert (r["top1_agreement"], r["trace_source"]) == (w["top1_agreement"], w["trace_source"])
            assert r["kl_mean"] == pytest.approx(w["kl_mean"], rel=1e-4, abs=1e-7)


@pytest.mark.integration
def test_two_processes_write_exactly_the_records_of_one(tmp_path, smollm2):
    grid = ["--dataset", "gsm8k:3", "--policies", "full,streaming", "--budgets", "48", "--buffer", "8"]
    grid += ["--max-new-tokens", "8", "--no-fidelity", "--no-progress"]
    out = tmp_path / "two.jsonl"
    done = torchrun(2, "eval", *grid, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the grid is complete" in done.stderr and not shard_files(out)

    model, tokenizer = smollm2
    one = tmp_path / "one.jsonl"
    run_grid(
        model, tokenizer, model_name="smollm2-135m", dataset="gsm8k:3", out=str(one), policies="full,streaming",
        budgets=[48], buffer=8, max_new_tokens=8, fidelity=False, progress=False,
    )  # fmt: skip
    _same(_units(out), _units(one))
    assert len(_units(one)) == 6
    assert read_records(out)[0]["id"] == read_records(one)[0]["id"]  # the same run, whatever the process count


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


def test_a_killed_rank_resumes_with_three_processes_every_unit_once(tmp_path, tiny_dir):
    dataset = tmp_path / "problems.jsonl"
    problems = [{"id": f"p{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
    problems[0]["solution"] = "0+0 = \\boxed{0}"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    grid = ["--model", str(tiny_dir), "--dataset", str(dataset), "--policies", "full,streaming,random"]
    grid += ["--budgets", "24", "--buffer", "4", "--max-new-tokens", "10", "--temperature", "0.8", "--samples", "2"]
    grid += ["--fidelity", "--batch-size", "3", "--no-progress"]
    out = tmp_path / "results.jsonl"

    dies = torchrun(2, "eval", *grid, "--out", str(out), entry=[str(HERE / "rank_that_dies.py")],
                    env={"DIE_RANK": "1", "DIE_AFTER": "3"})  # fmt: skip
    assert dies.returncode != 0 and not out.exists()
    killed = [r for r in read_records(tmp_path / "results.shard-1-of-2.jsonl") if r["kind"] != "manifest"]
    assert len(killed) == 3  # what it wrote before it died is on disk

    resumed = torchrun(3, "eval", *grid, "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the grid is complete" in resumed.stderr and not shard_files(out)
    merged = _units(out)
    for record in killed:
        assert merged[unit_key(record)] == record  # kept as written, not redone

    one = tmp_path / "one.jsonl"
    run_grid(
        str(tiny_dir), dataset=str(dataset), out=str(one), policies="full,streaming,random", budgets=[24], buffer=4,
        max_new_tokens=10, temperature=0.8, samples=2, fidelity=True, batch_size=3, progress=False,
    )  # fmt: skip
    _same(merged, _units(one))
    assert len(merged) == 4 * 3 * 2 + 4 * 2


def test_a_folder_renamed_under_a_launch_fails_it_naming_the_move_and_the_run_resumes_once_moved_back(
    tmp_path, tiny_dir
):
    # Both ranks used to exit 0 ("units of other shards are not done yet"), their records in a folder no
    # command would look in, never merged; a rank still loading its model re-created the old folder.
    dataset = tmp_path / "problems.jsonl"
    problems = [{"id": f"p{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    dataset.write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    grid = ["--model", str(tiny_dir), "--dataset", str(dataset), "--policies", "full,streaming", "--budgets", "24"]
    grid += ["--buffer", "4", "--max-new-tokens", "10", "--fidelity", "--no-progress"]
    folder, moved = tmp_path / "D", tmp_path / "D_moved"
    out = folder / "r.jsonl"
    joined = folder / "r.shard-1-of-2.jsonl.lock"  # rank 1 has joined (a rank started later sees a new --out)
    move = f"for i in $(seq 600); do [ -e {joined} ] && break; sleep 0.1; done; mv {folder} {moved}"
    fault = {"FAULT": move, "FAULT_AFTER": "3", "FAULT_RANK": "0"}
    done = torchrun(2, "eval", *grid, "--out", str(out), entry=[str(HERE / "faulty_eval.py")], env=fault)
    assert done.returncode != 0 and "was removed, renamed or replaced" in done.stderr, done.stderr[-3000:]
    assert "move it back and rerun the same command" in done.stderr or "move the folder back" in done.stderr
    assert not folder.exists()  # nothing re-created at the old path, by either rank
    written = {unit_key(r): r for path, _ in shard_files(moved / "r.jsonl") for r in read_records(path)
               if r["kind"] != "manifest"}  # fmt: skip
    assert len(written) >= 3

    moved.rename(folder)
    resumed = torchrun(2, "eval", *grid, "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the grid is complete" in resumed.stderr and not shard_files(out)
    merged = _units(out)
    assert len(merged) == 3 * 2 + 3 and all(merged[key] == record for key, record in written.items())
