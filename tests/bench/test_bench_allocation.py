"""``reasonkv bench --allocation``: the sweep's evicting entries under per-(layer, kv-head) budgets, their K/V bytes
per layer in the records and the report, and the combinations refused in one line."""

from __future__ import annotations

import json

import pytest

from reasonkv.cache import CacheSpec
from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--rounds", "1", "--no-plots"]
SWEEP = [*TINY, "--lengths", "64,128", "--budget", "32", "--buffer", "16", "--prompt-length", "16"]
LAYERS, HEADS, K, B = 4, 2, 32, 16
HEAD_TOKEN = 2 * 32 * 4  # one token of one kv-head in one layer: (K, V) x head_dim 32 x fp32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "allocation", [["pyramid"], pytest.param(["adaptive", "--padded-heads"], marks=pytest.mark.slow)], ids=str
)
def test_sweep_under_an_allocation_reports_bytes_per_layer(allocation, tmp_path, capsys):
    out = tmp_path / "alloc"
    name = allocation[0]
    assert main([*SWEEP, "--policies", "h2o", "--allocation", *allocation, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    assert f"--allocation {name}" in document["command"]
    records = {r["policy"]: r for r in document["records"]}
    assert {p: r["allocation"] for p, r in records.items()} == {"full": "uniform", "streaming": name, "h2o": name}
    config = records["h2o"]["config"]
    assert config["allocation"] == name and config["ragged_heads"] is ("--padded-heads" not in allocation)
    assert all("kv_bytes_by_layer" not in w for w in records["full"]["windows"])

    table = CacheSpec.build("h2o", K, B, allocation=name).budget_table(LAYERS, HEADS)  # tokens per head kept
    for policy in ("streaming", "h2o"):
        windows = {w["length"]: w for w in records[policy]["windows"]}
        for w in windows.values():
            if "--padded-heads" in allocation:  # the slots in use, each as wide as the widest head; capacity beyond
                assert sum(w["kv_bytes_by_layer"]) <= w["kv_bytes"]
            else:  # every layer evicts: the layers' regions add up to what the cache holds
                assert sum(w["kv_bytes_by_layer"]) == w["kv_bytes"]
            assert sum(w["kv_bytes_used_by_layer"]) == w["kv_bytes_used"]
            assert all(u <= h for u, h in zip(w["kv_bytes_used_by_layer"], w["kv_bytes_by_layer"], strict=True))
        used = windows[128]["kv_bytes_used_by_layer"]  # evicted many times by then: each head holds its budget
        assert len(used) == LAYERS
        if name == "pyramid":  # up to B more
            for layer in range(LAYERS):
                kept = int(table[layer].sum())
                assert kept * HEAD_TOKEN <= used[layer] <= (kept + HEADS * B) * HEAD_TOKEN
            assert used[0] > used[-1]  # the pyramid: more below, less above
        # K x layers x kv-heads in all (adaptive: shared by the scores), plus what each head added since
        assert K * LAYERS * HEADS * HEAD_TOKEN <= sum(used) <= (K + B) * LAYERS * HEADS * HEAD_TOKEN
    layers = document["summary"]["sweep"]["1"]["layers"]
    assert layers["allocation"] == name and set(layers["entries"]) == {"streaming", "h2o"}
    assert layers["uniform_layer_bytes"] == (K + B) * HEADS * HEAD_TOKEN
    assert layers["entries"]["h2o"]["used"] == records["h2o"]["windows"][-1]["kv_bytes_used_by_layer"]

    heads = "padded" if "--padded-heads" in allocation else "ragged"
    text = (out / "bench.md").read_text()
    assert f"## Length sweep (K = 32, B = 16, allocation {name}, {heads} heads)" in text
    for where in (text, printed):
        assert "K/V bytes per layer under the allocation" in where
        assert "| layer | streaming @128 | h2o @128 | uniform (K + B) |" in where
        assert f"| 3 | {records['h2o']['windows'][-1]['kv_bytes_by_layer'][3] / 1024:.1f} KiB (" in where

    # a rerun under another allocation is another configuration: refused, the folder kept
    capsys.readouterr()
    assert main([*SWEEP, "--policies", "h2o", "--out", str(out)]) == 2
    assert "another configuration" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "quest", "-o", "block_size=8"], "--allocation pyramid applies to evicting policies; quest"),
        (["--quantized", "8"], "--allocation pyramid cannot be combined with --quantized 8"),
        (["--eviction-cost", "--cached", "64"], "applies to the length sweep only, not to --eviction-cost"),
        (["--budgets-file", "b.json"], "budgets_file='b.json' (--budgets-file) does not apply to allocation 'pyramid'"),
        (["--adaptive-alpha", "0.5"], "adaptive_alpha=0.5 (--adaptive-alpha) does not apply to allocation 'pyramid'"),
    ],
)
def test_refused_combinations_say_so_in_one_line(extra, message, tmp_path, capsys):
    argv = [*SWEEP, "--policies", "h2o", "--allocation", "pyramid", *extra, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_padded_heads_and_calibrated_need_their_allocation(tmp_path, capsys):
    assert main([*SWEEP, "--padded-heads", "--out", str(tmp_path / "o")]) == 2
    said = "ragged=False (--padded-heads) does not apply to allocation 'uniform': it applies to allocations pyramid"
    assert said in capsys.readouterr().err
    assert main([*SWEEP, "--allocation", "calibrated", "--out", str(tmp_path / "o")]) == 2
    assert "needs a budget file" in capsys.readouterr().err


def test_what_the_cache_refuses_on_the_model_is_one_line(tmp_path, capsys):
    """A budget file for every layer of a hybrid model (4) instead of its evicting layers (2): the cache refuses
    it, said once before anything is measured."""
    budgets = tmp_path / "b.json"
    budgets.write_text(json.dumps({"layers": 4, "kv_heads": 2, "weights": [[1.0, 2.0]] * 4}))
    argv = [*SWEEP, "--model", "shape:tiny-hybrid", "--policies", "h2o", "--allocation", "calibrated"]
    assert main([*argv, "--budgets-file", str(budgets), "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "error" in line]
    assert len(lines) == 1 and "--allocation calibrated: budget file" in lines[0], lines
    assert "is for 4 layers x 2 kv-heads, but the model has 2 full-attention layers x 2 kv-heads" in lines[0]
    assert "sweep full" not in captured.err  # nothing measured


@pytest.mark.slow
def test_a_hybrid_sweep_under_an_allocation_reports_its_evicting_layers(tmp_path, capsys):
    """tiny-hybrid (sliding, full, sliding, full): the allocation shares its budgets over the two full-attention
    layers; their bytes per layer are what the evicting layers hold, the sliding layers' window beside them."""
    out = tmp_path / "hybrid"
    argv = [*SWEEP, "--model", "shape:tiny-hybrid", "--policies", "h2o", "--allocation", "pyramid"]
    assert main([*argv, "--out", str(out)]) == 0
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    h2o = next(r for r in document["records"] if r["policy"] == "h2o")
    assert h2o["allocation"] == "pyramid"
    table = CacheSpec.build("h2o", K, B, allocation="pyramid").budget_table(2, HEADS)
    used = h2o["windows"][-1]["kv_bytes_used_by_layer"]
    assert len(used) == 2 and used[0] > used[1]
    for layer in range(2):
        kept = int(table[layer].sum())
        assert kept * HEAD_TOKEN <= used[layer] <= (kept + HEADS * B) * HEAD_TOKEN
