"""``BenchSettings``: built once from the command line or in Python, checked once, spelled back as a command;
the plan's entries get their caches as ``CacheSpec``s."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from reasonkv.bench.plan import build_plan
from reasonkv.bench.settings import DEFAULT_LENGTHS, BenchSettings
from reasonkv.cache import DEFAULT_BUFFER
from reasonkv.cli.bench import settings_from
from reasonkv.cli.main import build_parser

EVERYTHING = ["--model", "shape:tiny", "--threads", "2", "--policies", "streaming,snapkv", "-o", "snapkv.window=8"]
EVERYTHING += ["--budget", "64", "--buffer", "16", "--seed", "3", "--quantized", "16", "--bits", "4"]
EVERYTHING += ["--lengths", "1024,2048", "--batch-sizes", "2,1", "--prompt-length", "16", "--window", "32"]
EVERYTHING += ["--prefill-to-length", "--transformers-cache", "--decode-steps", "64", "--no-sync-timing"]
EVERYTHING += ["--prefill-chunk", "512", "--eviction-cost", "--cached", "80", "--repeats", "2", "--max-batch"]
EVERYTHING += ["--memory-limit", "24GiB", "--length", "4096", "--probe-batches", "4,1", "--probe-steps", "3"]
EVERYTHING += ["--max-measured-batch", "8", "--out", "some folder", "--force", "--no-progress", "--no-plots"]


def _settings(argv: list[str]) -> BenchSettings:
    return settings_from(build_parser(["bench"]).parse_args(["bench", *argv]))


ALLOCATED = ["--allocation", "adaptive", "--adaptive-alpha", "0.5", "--padded-heads", "--lengths", "64,128"]
ALLOCATED += ["--out", "o"]


@pytest.mark.parametrize("argv", [["--out", "o"], EVERYTHING, ALLOCATED], ids=["defaults", "every-flag", "allocation"])
def test_the_command_line_it_spells_out_builds_the_same_settings(argv):
    settings = _settings(argv)
    command = shlex.split(settings.command())
    assert command[:2] == ["reasonkv", "bench"]
    # everything but how the run shows itself (progress bars, plots)
    assert _settings(command[2:]) == dataclasses.replace(settings, progress=True, plots=True)
    arguments = settings.arguments()
    assert arguments["command"] == "bench" and arguments["out"] == str(settings.out)
    assert set(arguments) == {"command"} | set(vars(build_parser(["bench"]).parse_args(["bench", *argv]))) - {"run"}


def test_defaults_and_python_values():
    settings = BenchSettings(out=Path("o"))
    assert settings.dtype == "bf16" and settings.buffer == DEFAULT_BUFFER and settings.modes == ["sweep"]
    assert settings.sweep_lengths == DEFAULT_LENGTHS and settings.sweep_window == DEFAULT_BUFFER
    assert settings == _settings(["--out", "o"])
    typed = BenchSettings(out="o", policies=["streaming"], lengths=[64, 128], batch_sizes=(2, 1), option="sinks=2")
    text = _settings(["--out", "o", "--policies", "streaming", "--lengths", "64,128", "--batch-sizes", "2,1"])
    assert typed == BenchSettings(**{**vars(text), "option": ("sinks=2",)})
    assert typed.lengths == (64, 128) and typed.batch_sizes == (2, 1) and typed.policies == ("streaming",)
    assert BenchSettings(out="o", max_batch=True, memory_limit="1KiB", length=300).memory_limit_bytes == 1024
    assert BenchSettings(out="o", max_batch=True, memory_limit="1KiB", length=300).modes == ["max-batch"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"budget": "512"}, "--budget must be a positive integer, got 512"),
        ({"buffer": -1}, "--buffer must be a non-negative integer, got -1"),
        ({"threads": 0}, "--threads must be at least 1, got 0"),
        ({"force": "yes"}, "force must be True or False"),
        ({"seed": 1.5}, "--seed must be an integer"),
        ({"lengths": [128, 64]}, "--lengths must be strictly increasing"),
        ({"batch_sizes": [1, 1]}, "--batch-sizes: repeated values"),
        ({"lengths": [64, True]}, "True is not an integer"),
        ({"policies": " , "}, "--policies: give policy names"),
        ({"bits": 4}, "bits=4 has no effect without a quantized tier"),
        ({"eviction_cost": True, "cached": 100, "buffer": 0}, "1 <= --buffer < --cached"),
        ({"max_batch": True, "memory_limit": "lots", "length": 300}, "not a number with a unit"),
        ({"max_batch": True, "memory_limit": "1GiB", "length": 300, "probe_batches": [2]}, "two different"),
        ({"transformers_cache": True, "prefill_to_length": True, "eviction_cost": True, "cached": 200}, "sweep"),
        ({"prefill_to_length": True, "lengths": [1024], "window": 300}, "--window 300 exceeds --decode-steps 256"),
        ({"allocation": "nope"}, "allocation must be one of uniform, pyramid"),
        ({"allocation": "adaptive", "adaptive_alpha": 2}, r"must be a number in \[0, 1\], got 2 \(--adaptive-alpha\)"),
        ({"allocation": "pyramid", "padded_heads": "yes"}, "padded_heads must be True or False"),
        ({"allocation": "pyramid", "max_batch": True, "memory_limit": "1GiB", "length": 300}, "not to --max-batch"),
    ],
)
def test_bad_settings_name_the_flag_and_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        BenchSettings(out="o", **changes)


def test_every_entry_gets_its_cache_spec():
    argv = ["--model", "shape:tiny", "--policies", "snapkv", "--budget", "40", "--buffer", "8", "--lengths", "256"]
    argv += ["--prefill-to-length", "--decode-steps", "16", "--transformers-cache", "--quantized", "8"]
    argv += ["--eviction-cost", "--cached", "48", "--max-batch", "--memory-limit", "1GiB", "--length", "64"]
    plan = build_plan(_settings([*argv, "--out", "o"]))
    sweep, eviction, batch = (plan.specs[mode] for mode in ("sweep", "eviction-cost", "max-batch"))
    assert plan.policies == ["full", "transformers", "streaming", "snapkv", "snapkv+int8:8"]
    assert set(sweep) == set(plan.policies)
    assert sweep["transformers"] is None  # transformers' own cache, no reasonkv hook
    assert sweep["full"].budget is None and batch["full"].budget is None  # the full cache evicts nothing
    assert (sweep["snapkv"].budget, sweep["snapkv"].buffer, sweep["snapkv"].seed) == (40, 8, 0)
    assert sweep["snapkv+int8:8"] is sweep["snapkv"]  # tiered once the model gives the bytes of a token
    assert set(eviction) == {"streaming", "snapkv"} and eviction["snapkv"].trigger == 48  # --cached: K + B
    assert set(batch) == {"full", "snapkv"} and batch["snapkv"].budget == 40
    assert all(spec.policy.name == "snapkv" for spec in (sweep["snapkv"], eviction["snapkv"], batch["snapkv"]))
    assert [(mode, policy) for mode, policy, _ in plan.entries()] == [
        *(("sweep", p) for p in plan.policies),
        ("eviction-cost", "streaming"),
        ("eviction-cost", "snapkv"),
        ("max-batch", "full"),
        ("max-batch", "snapkv"),
    ]


def test_options_reach_the_cache_specs():
    plan = build_plan(BenchSettings(out="o", model="shape:tiny", policies=["snapkv"], option=["snapkv.window=8"]))
    assert plan.specs["sweep"]["snapkv"].policy.window == 8 and plan.options["snapkv"] == {"window": 8}
    with pytest.raises(ValueError, match="snapkv: .* protected tokens exceed the budget 16"):
        build_plan(BenchSettings(out="o", model="shape:tiny", policies=["snapkv"], budget=16, lengths=[64]))
    skipped = build_plan(BenchSettings(out="o", model="shape:tiny", budget=16, lengths=[64]))  # 'all': skipped
    assert "snapkv" not in skipped.policies and any(w.startswith("skipping snapkv: ") for w in skipped.warnings)


def test_an_allocation_reaches_the_evicting_entries_of_the_sweep():
    settings = BenchSettings(out="o", model="shape:tiny", policies=["h2o"], budget=32, buffer=16, lengths=[64, 128])
    allocated = dataclasses.replace(settings, allocation="adaptive", adaptive_alpha=0.5, padded_heads=True)
    plan = build_plan(allocated)
    specs = plan.specs["sweep"]
    assert specs["full"].allocation == "uniform"  # nothing evicted, nothing to share
    for name in ("streaming", "h2o"):
        assert specs[name].allocation == "adaptive" and specs[name].adaptive_alpha == 0.5
        assert specs[name].ragged is False
    config = plan.configs["sweep"]
    assert config["allocation"] == "adaptive" and config["ragged_heads"] is False and config["adaptive_alpha"] == 0.5
    # the uniform allocation leaves the configuration as it was before allocations existed
    assert "allocation" not in build_plan(settings).configs["sweep"]


def test_policies_all_under_an_allocation_leaves_the_selection_policies_out():
    settings = BenchSettings(out="o", model="shape:tiny", budget=64, buffer=16, lengths=[256], allocation="pyramid")
    plan = build_plan(settings)
    assert "quest" not in plan.policies and "seer" not in plan.policies and "h2o" in plan.policies
    assert any(w.startswith("skipping quest, seer under --allocation pyramid") for w in plan.warnings)
    assert all(spec.allocation == "pyramid" for name, spec in plan.specs["sweep"].items() if name != "full")
    with pytest.raises(ValueError, match="--allocation pyramid applies to evicting policies; seer selects"):
        build_plan(dataclasses.replace(settings, policies=("h2o", "seer")))
