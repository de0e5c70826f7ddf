"""``reasonkv bench --ragged``: each evicting policy again with its rows evicting at different steps, beside
the rows evicting together, in one run."""

from __future__ import annotations

import json

import pytest

from reasonkv.bench.plan import build_plan
from reasonkv.bench.prefilled import ragged_shifts
from reasonkv.bench.settings import BenchSettings
from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--no-plots", "--rounds", "1"]
PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny: 4 layers x (K, V) x 2 kv heads x head_dim 32 x fp32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ragged_rows_are_spread_over_one_eviction_cycle():
    assert ragged_shifts(4, 16) == [0, 4, 8, 12]
    assert ragged_shifts(8, 4) == list(range(8))  # at least one token apart


@pytest.mark.slow
def test_a_ragged_variant_runs_beside_its_policy_at_batch_sizes_above_one(tmp_path, capsys):
    out = tmp_path / "ragged"
    args = [*TINY, "--policies", "streaming", "--lengths", "160", "--prefill-to-length", "--decode-steps", "32"]
    args += ["--budget", "48", "--buffer", "16", "--batch-sizes", "1,4", "--ragged", "--out", str(out)]
    assert main(args) == 0
    assert "Rows evicting at different steps" in capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    assert "--ragged" in document["command"]
    entries = {(r["policy"], r["batch"]) for r in document["records"]}
    assert ("streaming~ragged", 4) in entries and ("streaming~ragged", 1) not in entries
    records = {(r["policy"], r["batch"]): r for r in document["records"]}
    [ragged] = [w for w in records[("streaming~ragged", 4)]["windows"] if w["length"] == 160]
    [together] = [w for w in records[("streaming", 4)]["windows"] if w["length"] == 160]
    assert ragged["row_shifts"] == [0, 4, 8, 12]
    # 32 steps, B = 16: rows evicting together evict twice, all at once; staggered rows evict apart.
    assert together["evictions"] == 2 and ragged["evictions"] == 8
    # A ragged batch keeps B slots more (so that an eviction rewrites only its own rows): K + 2B at most.
    assert together["kv_bytes"] == (48 + 16) * PER_TOKEN * 4 and ragged["kv_bytes"] <= (48 + 32) * PER_TOKEN * 4
    summary = document["summary"]["ragged"]["4"]["streaming~ragged"]
    assert summary["evictions"]["160"] == 8 and summary["lockstep_evictions"]["160"] == 2
    assert summary["step_vs_lockstep"]["160"] == pytest.approx(ragged["step_mean_s"] / together["step_mean_s"])
    assert document["summary"]["sweep"]["4"]["policies"]["streaming~ragged"]["kv_within_bound"]
    assert "| streaming~ragged | 160 |" in (out / "bench.md").read_text()


def test_ragged_needs_a_prefilled_sweep_of_batches(tmp_path):
    common = dict(model="shape:tiny", dtype="fp32", policies="streaming", buffer=16, out=tmp_path / "x", ragged=True)
    with pytest.raises(ValueError, match="--ragged needs the length sweep with --prefill-to-length"):
        BenchSettings(**common, lengths="160", batch_sizes="4")
    with pytest.raises(ValueError, match="and a batch size above 1 \\(--batch-sizes 1\\)"):
        BenchSettings(**common, lengths="160", prefill_to_length=True, decode_steps=32)
    with pytest.raises(ValueError, match="plus the 33 untimed steps that stagger a batch of 8 rows, got 60"):
        BenchSettings(**common, lengths="60", prefill_to_length=True, decode_steps=32, batch_sizes="8")
    sweep = dict(lengths="160", prefill_to_length=True, decode_steps=32, batch_sizes="1,2")
    plan = build_plan(BenchSettings(**common, **sweep))
    assert plan.ragged == {"streaming~ragged": "streaming"}  # the references (full, streaming) are not varied
    assert [(p, b) for _, p, b in plan.entries() if p.endswith("~ragged")] == [("streaming~ragged", 2)]
