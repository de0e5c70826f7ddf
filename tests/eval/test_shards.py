"""One grid across processes: the split, shard files, the merge, resuming with another process count, locks."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.grid import make_cells
from reasonkv.eval.manifest import grid_identity, grid_sha256
from reasonkv.eval.plan import plan_grid
from reasonkv.eval.records import unit_key
from reasonkv.eval.runner import run_grid
from reasonkv.eval.shards import Shard, join_run, merge_shards, read_run, shard_files, shard_path, steps_lock_path
from reasonkv.eval.units import Unit, assign, decode_cost, grid_units
from reasonkv.runs.outputs import OutputLock, OutputLocked
from reasonkv.runs.store import read_records

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO = TESTS_DIR.parent

PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2?", "answer": "4", "solution": "2+2 = <<2+2=4>>4.\n#### 4"},
    {"id": "p2", "problem": "Half of 10?", "answer": "5", "solution": "Half of ten is \\boxed{5}."},
    {"id": "p3", "problem": "Say seven.", "answer": "7"},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def _grid(dataset: str, **overrides) -> dict:
    kwargs = dict(
        dataset=dataset,
        policies="full,streaming,random",
        budgets=[10, 16],
        buffer=4,
        max_new_tokens=12,
        batch_size=4,
        temperature=0.7,
        samples=2,
        fidelity=True,
        progress=False,
    )
    kwargs.update(overrides)
    return kwargs


def _units(path) -> dict[tuple, dict]:
    """Result records by unit; fails if a unit appears twice."""
    records = [r for r in read_records(path) if r["kind"] != "manifest"]
    keys = Counter(unit_key(r) for r in records)
    assert max(keys.values()) == 1, "a unit was recorded twice"
    return {unit_key(r): r for r in records}


def _same_results(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, r in got.items():
        w = want[key]
        if r["kind"] == "generation":
            assert (r["output_ids"], r["extracted_answer"], r["correct"]) == (
                w["output_ids"],
                w["extracted_answer"],
                w["correct"],
            )
        else:
            assert (r["top1_agreement"], r["trace_source"]) == (w["top1_agreement"], w["trace_source"])
            assert r["kl_mean"] == pytest.approx(w["kl_mean"], rel=1e-4, abs=1e-7)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def reference(dataset, tmp_path, model) -> dict:
    out = tmp_path / "one-process.jsonl"
    run_grid(model, NoEosTokenizer(), out=str(out), **_grid(dataset))
    return _units(out)


# ---------------------------------------------------------------------------------- the split


def test_the_split_covers_every_unit_once_deals_every_stratum_evenly_and_balances_cost():
    cells = make_cells(["full", "streaming", "random"], [64, 1024], 16)

    class P:
        def __init__(self, i):
            self.id = f"q{i}"

    datasets = [("long", [P(i) for i in range(7)]), ("short", [P(i) for i in range(23)])]
    samples = {(name, i): 3 if cells[i].stochastic else 1 for name, _ in datasets for i in range(len(cells))}
    units = grid_units(datasets, cells, samples, fidelity=True)
    owner = assign(units, cells, 4, max_new_tokens=2048, fidelity_tokens=2048)
    assert owner == assign(list(units), cells, 4, max_new_tokens=2048, fidelity_tokens=2048)  # deterministic
    assert set(owner) == set(units) and set(owner.values()) == {0, 1, 2, 3}
    generations = [u for u in units if u.kind == "generation"]
    for stratum in {(u.dataset, u.cell) for u in generations}:
        counts = Counter(owner[u] for u in generations if (u.dataset, u.cell) == stratum)
        per_shard = [counts.get(r, 0) for r in range(4)]
        assert max(per_shard) - min(per_shard) <= 1, (stratum, per_shard)  # long answers, big budgets spread
    for u in units:  # a problem's fidelity replays run where its greedy full-cache answer is decoded
        if u.kind == "fidelity":
            assert owner[u] == owner[Unit("generation", u.dataset, u.problem, 0, 0)]
    cost = Counter()
    for u in units:
        cell = cells[u.cell]
        cap = None if cell.budget is None else cell.budget + cell.buffer
        cost[owner[u]] += decode_cost(2048, cap) * (1 if u.kind == "generation" else 0) + (
            decode_cost(2048, None) + decode_cost(2048, cap) if u.kind == "fidelity" else 0
        )
    biggest = decode_cost(2048, None) + 4 * (decode_cost(2048, None) + decode_cost(2048, 64 + 16))
    assert max(cost.values()) - min(cost.values()) <= biggest
    assert decode_cost(100, None) > decode_cost(100, 50) > decode_cost(100, 10)


def test_a_plan_needs_no_model_and_shows_each_shards_share(dataset, capsys):
    plan = plan_grid(**{k: v for k, v in _grid(dataset).items() if k != "progress"}, shard="1/3")
    assert plan.shard == Shard(1, 3) and len(plan.units) == 3 * 5 * 2 + 3 * 4  # at temperature 0.7 all sample twice
    from reasonkv.cli import main

    argv = ["eval", "--dataset", dataset, "--policies", "full,streaming", "--budgets", "10", "--max-new-tokens", "64"]
    assert main([*argv, "--plan", "--shard", "0/2", "--model", "no-such-model"]) == 0
    out = capsys.readouterr().out
    assert "6 generation units (at most 384 new tokens" in out
    assert "shard 0/2: " in out and "shard 1/2: " in out


def test_the_shard_comes_from_the_launcher_or_the_flag_never_both():
    assert Shard.resolve(None, {}) == Shard(0, 1)
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}
    launched = Shard.resolve(None, env)
    assert (launched.index, launched.count, launched.local_rank) == (5, 8, 1)
    assert launched.device("cuda") == "cuda:1" and launched.device("cpu") == "cpu"
    with pytest.raises(ValueError, match="names one GPU"):
        launched.device("cuda:0")
    assert Shard.resolve("2/3", {}) == Shard(2, 3) and Shard.resolve((0, 2), {"WORLD_SIZE": "1"}) == Shard(0, 2)
    with pytest.raises(ValueError, match="the launcher already splits"):
        Shard.resolve("0/2", env)
    for bad, message in [("3/3", "must be in 0..2"), ("1-2", "takes I/N"), ("0/0", "N >= 1")]:
        with pytest.raises(ValueError, match=message):
            Shard.parse(bad)
    with pytest.raises(ValueError, match="must be integers"):
        Shard.from_env({"WORLD_SIZE": "two"})
    assert shard_path("runs/results.jsonl", Shard(1, 4)) == Path("runs/results.shard-1-of-4.jsonl")
    assert shard_path("runs/results", Shard(0, 2)) == Path("runs/results.shard-0-of-2")


# ---------------------------------------------------------------------------------- shards and the merge


def test_shards_run_one_after_another_give_the_records_of_one_process(dataset, tmp_path, model, reference):
    out = tmp_path / "runs" / "results.jsonl"  # its folder is created
    counts = []
    for index in range(3):
        result = run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 3), **_grid(dataset))
        counts.append(result.generated + result.fidelity)
        assert result.written_to == shard_path(out, Shard(index, 3))
        assert result.complete == (index == 2) and (result.merged is not None) == (index == 2)
    assert min(counts) > 0 and sum(counts) == len(reference)
    left = sorted(p.name for p in out.parent.iterdir())
    assert not shard_files(out) and [name for name in left if not name.endswith(".lock")] == ["results.jsonl"]
    assert all(OutputLock.holder(out.parent / name) is None for name in left)  # lock files stay, free
    _same_results(_units(out), reference)
    manifests = [r for r in read_records(out) if r["kind"] == "manifest"]
    assert len(manifests) == 1 and read_records(out)[0] == manifests[0]  # the same run: one manifest
    assert all(r["run"] == manifests[0]["id"] for r in read_records(out)[1:])


class Crash(BaseException):
    """A process dying mid-run (not an Exception: nothing may catch it)."""


def _crashed(model, kwargs: dict, after: int) -> None:
    written = []

    def crash(record):
        written.append(record)
        if len(written) == after:
            raise Crash

    with pytest.raises(Crash):
        run_grid(model, NoEosTokenizer(), on_record=crash, **kwargs)


@pytest.mark.slow
def test_a_killed_shard_resumes_with_another_number_of_processes(dataset, tmp_path, model, reference):
    out = tmp_path / "results.jsonl"
    grid = _grid(dataset)
    _crashed(model, {**grid, "out": str(out), "shard": (1, 2)}, after=4)  # shard 1 of 2 dies after 4 records
    # (a rank killed by SIGKILL under torchrun: tests/eval/test_torchrun.py)
    killed = shard_path(out, Shard(1, 2))
    survivors = [r for r in read_records(killed) if r["kind"] != "manifest"]
    assert len(survivors) == 4
    first = run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **grid)
    assert not first.complete and first.missing > 0 and first.merged is None  # shard 1 is not done: no merge
    assert not out.exists()

    done = [run_grid(model, NoEosTokenizer(), out=str(out), shard=(i, 3), **grid) for i in range(3)]
    assert sum(r.skipped for r in done) == len(survivors) + first.generated + first.fidelity
    assert done[-1].complete and done[-1].merged == len(reference)
    assert not shard_files(out)
    merged = _units(out)
    _same_results(merged, reference)
    for record in survivors:  # what the killed process wrote is kept as it was
        assert merged[unit_key(record)] == record


@pytest.mark.slow
def test_a_single_process_finishes_a_sharded_run_and_merges_it(dataset, tmp_path, model, reference):
    out = tmp_path / "results.jsonl"
    run_grid(model, NoEosTokenizer(), out=str(out), shard="1/2", **_grid(dataset))
    result = run_grid(model, NoEosTokenizer(), out=str(out), **_grid(dataset))
    assert result.skipped > 0 and result.complete and result.merged is not None
    assert not shard_files(out)
    _same_results(_units(out), reference)
    assert merge_shards(out, read_records(out)[0]["grid"]["sha256"]) == 0  # nothing left: a merge is idempotent


# ---------------------------------------------------------------------------------- locks


_HOLDER = """
import sys, time
from reasonkv.runs.outputs import OutputLock
OutputLock(sys.argv[1], "eval", path=sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(120)
"""


class Holder:
    """A process holding the lock of ``target`` (lock file ``path``) until stopped or killed."""

    def __init__(self, target: Path, path: Path):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(target), str(path)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout.readline().strip() == "held"

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def test_a_second_writer_fails_at_once_naming_the_file_and_the_holder(dataset, tmp_path, model):
    out = tmp_path / "results.jsonl"
    grid = _grid(dataset, policies="full", fidelity=False, samples=1)
    run_grid(model, NoEosTokenizer(), out=str(out), **grid)
    before = out.read_bytes()
    holder = Holder(out, tmp_path / "results.jsonl.lock")
    try:
        start = time.monotonic()
        with pytest.raises(OutputLocked, match=rf"{out} is in use by pid {holder.process.pid} \(reasonkv eval"):
            run_grid(model, NoEosTokenizer(), out=str(out), **grid)
        assert time.monotonic() - start < 5  # at once, not after a wait
        with pytest.raises(OutputLocked, match=f"pid {holder.process.pid}"):  # nor may a sharded launch start
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **grid)
    finally:
        holder.kill()
    assert out.read_bytes() == before and not shard_files(out)
    assert (tmp_path / "results.jsonl.lock").read_text()  # the killed holder's record: stale, and harmless
    again = run_grid(model, NoEosTokenizer(), out=str(out), **{**grid, "samples": 2})  # a second sample each
    assert again.generated == 3 and again.skipped == 3 and OutputLock.holder(tmp_path / "results.jsonl.lock") is None


def test_shard_locks_keep_launches_of_another_size_and_a_single_process_out(dataset, tmp_path, model):
    out = tmp_path / "results.jsonl"
    grid = _grid(dataset, policies="full", fidelity=False, samples=1)
    holder = Holder(shard_path(out, Shard(0, 2)), tmp_path / "results.shard-0-of-2.jsonl.lock")
    try:
        with pytest.raises(OutputLocked, match=f"results.shard-0-of-2.jsonl is in use by pid {holder.process.pid}"):
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **grid)
        with pytest.raises(OutputLocked, match="split into 2 shards"):
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 3), **grid)
        with pytest.raises(OutputLocked, match="split into 2 shards"):
            run_grid(model, NoEosTokenizer(), out=str(out), **grid)
        sibling = run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 2), **grid)  # the same launch: fine
        assert sibling.generated > 0 and not sibling.complete
    finally:
        holder.kill()
    assert not out.exists()
    result = run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **grid)  # the stale lock is no obstacle
    assert result.complete and result.merged == 3 and not shard_files(out)


def test_the_command_line_takes_its_shard_from_the_launcher(dataset, tmp_path, monkeypatch, capsys):
    from reasonkv.cli import eval as eval_command
    from reasonkv.cli import main

    real = eval_command.run_grid  # patched where the command looks it up, so the patch is undone there too
    monkeypatch.setattr(eval_command, "run_grid", lambda name, **kw: real(tiny_llama(), NoEosTokenizer(), **kw))
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "results.jsonl"
    argv = ["eval", "--dataset", dataset, "--policies", "full", "--max-new-tokens", "4", "--no-fidelity"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    assert "shard 1/2 of" in capsys.readouterr().err
    assert [p.name for p, _ in shard_files(out)] == ["results.shard-1-of-2.jsonl"] and not out.exists()
    assert main([*argv, "--shard", "0/2", "--out", str(out)]) == 2
    assert "the launcher already splits the grid" in capsys.readouterr().err


@pytest.mark.slow
def test_a_merge_killed_halfway_is_simply_done_again(dataset, tmp_path, model, reference, monkeypatch):
    from reasonkv.eval import records, runner

    out = tmp_path / "results.jsonl"
    for index in range(2):
        with monkeypatch.context() as patch:
            patch.setattr(runner, "merge_shards", lambda out, grid: None)  # both shards done, no merge yet
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 2), **_grid(dataset))
    append = records.ResultsFile.append
    appended = []

    def dies_while_merging(self, record):
        append(self, record)
        appended.append(record)
        if len(appended) == 5:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write('{"kind": "generation", "mod')  # and a torn line, as a kill mid-write leaves
            raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(records.ResultsFile, "append", dies_while_merging)
        with pytest.raises(Crash):
            merge_shards(out, read_records(shard_path(out, Shard(0, 2)))[0]["grid"]["sha256"])
    assert len(shard_files(out)) == 2  # nothing is deleted before the merge is complete
    partial = [r for r in read_records(out) if r["kind"] != "manifest"]
    assert len(partial) == 5
    result = run_grid(model, NoEosTokenizer(), out=str(out), **_grid(dataset))  # any rerun merges again
    assert result.generated == result.fidelity == 0 and result.merged == len(reference) - 5
    assert not shard_files(out)
    _same_results(_units(out), reference)


# ---------------------------------------------------------------------------------- one grid per run


def test_a_shard_file_of_another_grid_is_refused_before_loading_never_merged_never_deleted(dataset, tmp_path, model):
    out = tmp_path / "r.jsonl"
    grid = _grid(dataset, policies="full,streaming", budgets=[10], fidelity=False, temperature=0.0, samples=1)
    run_grid(model, NoEosTokenizer(), out=str(out), **grid)  # complete
    other = {**grid, "policies": "full,h2o"}
    run_grid(model, NoEosTokenizer(), out=str(tmp_path / "other.jsonl"), shard=(0, 2), **other)
    foreign = shard_path(out, Shard(0, 2))
    (tmp_path / "other.shard-0-of-2.jsonl").rename(foreign)  # placed beside the complete run
    before = {p: p.read_bytes() for p in (out, foreign)}
    cells = "policies: [full, h2o@10] there, [full, streaming@10] now"
    refusal = re.escape(f"{foreign} is a shard of a run with another grid ({cells})")
    with pytest.raises(ValueError, match=refusal + ": it is never merged into"):
        run_grid("no-such-model", model_name="LlamaForCausalLM", out=str(out), **grid)  # refused before loading
    with pytest.raises(ValueError, match=refusal):
        run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 2), **grid)
    assert merge_shards(out, read_records(out)[0]["grid"]["sha256"]) == 0  # a merge of this grid leaves it too
    assert {p: p.read_bytes() for p in (out, foreign)} == before


def test_ranks_launched_with_different_grids_are_refused_at_start_naming_what_differs(dataset, tmp_path, model):
    out = tmp_path / "r.jsonl"
    grid = _grid(dataset, policies="full,streaming", budgets=[10], fidelity=False)
    first = run_grid(model, NoEosTokenizer(), out=str(tmp_path / "probe.jsonl"), **grid)  # the manifest this grid gets
    manifest = read_records(first.path)[0]
    identity = grid_identity(manifest["grid"], manifest["setup"])
    plan = {"tool": "reasonkv", "kind": "plan", "sha256": grid_sha256(identity), "grid": identity,
            "model": "LlamaForCausalLM", "dtype": "fp32"}  # fmt: skip
    rank0, _ = join_run(out, Shard(0, 2), plan)  # rank 0 joined and is loading its model: no shard file yet
    try:
        for change, named in [
            (dict(policies="full,h2o"), "policies: [full, streaming@10] there, [full, h2o@10] now"),
            (dict(max_new_tokens=16), "max_new_tokens: 12 there, 16 now"),
            (dict(budgets=[10, 16]), "policies: [full, streaming@10] there, [full, streaming@10, streaming@16] now"),
        ]:
            with pytest.raises(ValueError, match=re.escape(f"{out} is being run with other settings ({named}")):
                run_grid(
                    "no-such-model", model_name="LlamaForCausalLM", out=str(out), shard=(1, 2), **{**grid, **change}
                )
        with pytest.raises(ValueError, match="is being run with other settings .model: 'LlamaForCausalLM' there, 'x'"):
            run_grid("no-such-model", model_name="x", out=str(out), shard=(1, 2), **grid)
        assert not shard_files(out)
        rank1 = run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 2), **grid)  # the same arguments: runs
        assert rank1.generated > 0 and not rank1.complete
    finally:
        rank0.release()
    done = run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **grid)
    assert done.complete and done.merged is not None and not (tmp_path / "r.plan.json").exists()


@pytest.mark.slow
def test_in_bf16_batches_of_one_give_the_records_of_one_process_whatever_the_process_count(dataset, tmp_path):
    # The claim as the README states it: in bf16 a prompt's tokens can depend on the batch it is decoded in, and
    # the split changes batches, so the records are independent of the process count at --batch-size 1.
    model = tiny_llama(dtype=torch.bfloat16)
    grid = _grid(dataset, policies="full,streaming,random", budgets=[10], batch_size=1)
    one = run_grid(model, NoEosTokenizer(), out=str(tmp_path / "one.jsonl"), **grid)
    out = tmp_path / "three.jsonl"
    for index in range(3):
        run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 3), **grid)
    got, want = _units(out), _units(one.path)
    assert set(got) == set(want) and len(got) == 3 * 3 * 2 + 3 * 2  # 3 problems x 3 cells x 2 samples, replays
    for key, record in got.items():
        fields = ("output_ids", "seed", "evictions") if record["kind"] == "generation" else ("kl_mean", "kl_max")
        assert {f: record[f] for f in fields} == {f: want[key][f] for f in fields}  # exactly, not approximately


@pytest.mark.slow
def test_a_rank_reads_the_run_only_between_merges_so_no_shard_file_vanishes_while_it_reads(
    dataset, tmp_path, model, reference, monkeypatch
):
    # A rank finishing while the last one merges listed the shard files, then read one the merge had just
    # deleted: a traceback (exit 1) for a run that was complete.
    from reasonkv.eval import runner

    out = tmp_path / "results.jsonl"
    for index in range(2):
        with monkeypatch.context() as patch:
            patch.setattr(runner, "merge_shards", lambda out, grid: None)  # both shards done, no merge yet
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 2), **_grid(dataset))
    grid = read_records(shard_path(out, Shard(0, 2)))[0]["grid"]["sha256"]
    seen: list[dict] = []
    merging = OutputLock(out, "merge", path=steps_lock_path(out)).acquire()  # as a merge holds it
    try:
        reader = threading.Thread(target=read_run, args=(out, grid, seen.append))
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and not seen  # waits for the merge
    finally:
        merging.release()
    assert merge_shards(out, grid) == len(reference)  # a real merge now races the reader: it reads before or after
    reader.join(timeout=60)
    assert not reader.is_alive() and not shard_files(out)
    assert {unit_key(r) for r in seen if r["kind"] != "manifest"} == set(reference)


@pytest.mark.slow
def test_a_full_disk_during_the_merge_names_the_step_keeps_the_shard_files_and_a_rerun_merges(
    dataset, tmp_path, model, reference, monkeypatch
):
    from reasonkv.eval import runner
    from reasonkv.runs import store

    out = tmp_path / "results.jsonl"
    for index in range(2):
        with monkeypatch.context() as patch:
            patch.setattr(runner, "merge_shards", lambda out, grid: None)  # both shards done, no merge yet
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(index, 2), **_grid(dataset))
    shards = {path: path.read_bytes() for path, _ in shard_files(out)}
    write, lines = os.write, []

    def fills_up(fd, data):  # the disk fills after the manifest and 4 appended lines of --out: half of the next goes in
        if os.readlink(f"/proc/self/fd/{fd}") != str(out):
            return write(fd, data)
        if len(lines) == 4:
            write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        lines.append(data)
        return write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(store.os, "write", fills_up)
        with pytest.raises(OSError) as error:
            merge_shards(out, read_records(shard_path(out, Shard(0, 2)))[0]["grid"]["sha256"])
    assert str(error.value) == (
        f"merging the shard files into {out}: {out}: appending a record failed (No space left on device); the 4 "
        "complete records in it are safe; free some space, then rerun the same command: it resumes (the shard "
        "files are complete and kept)"
    )
    assert {path: path.read_bytes() for path, _ in shard_files(out)} == shards and len(read_records(out)) == 1 + 4
    result = run_grid(model, NoEosTokenizer(), out=str(out), **_grid(dataset))  # space again: the rerun merges
    assert result.complete and not shard_files(out)
    _same_results(_units(out), reference)


@pytest.mark.slow
def test_a_rank_whose_model_loads_while_another_merges_reads_the_run_as_it_is_then(
    dataset, tmp_path, model, reference, monkeypatch
):
    # Rank 1 joins, and while its model loads rank 0 finishes, merges and deletes its shard file: rank 1 read
    # the files it had listed before the load, found one gone, and failed with a traceback for a complete run.
    from reasonkv.eval import records, runner

    out = tmp_path / "results.jsonl"
    with monkeypatch.context() as patch:
        patch.setattr(runner, "merge_shards", lambda out, grid: None)
        run_grid(model, NoEosTokenizer(), out=str(out), shard=(1, 2), **_grid(dataset))  # rank 1's units: done
    append = records.ResultsFile.append

    def killed_after_two(self, record):
        append(self, record)
        if len(read_records(self.path)) == 3:
            raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(records.ResultsFile, "append", killed_after_two)
        with pytest.raises(Crash):
            run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **_grid(dataset))  # rank 0: 2 units

    def load_while_rank_0_finishes(name, **kwargs):
        rank0 = run_grid(model, NoEosTokenizer(), out=str(out), shard=(0, 2), **_grid(dataset))
        assert rank0.merged is not None and not shard_path(out, Shard(0, 2)).exists()  # merged and deleted
        return model, NoEosTokenizer()

    monkeypatch.setattr(runner, "load_model", load_while_rank_0_finishes)
    rank1 = run_grid("tiny", model_name="LlamaForCausalLM", out=str(out), shard=(1, 2), **_grid(dataset))
    assert rank1.complete and rank1.generated == rank1.fidelity == 0 and not shard_files(out)
    _same_results(_units(out), reference)
