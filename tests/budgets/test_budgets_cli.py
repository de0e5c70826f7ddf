"""``--allocation`` on the command line: parsed into the cache's settings, refused clearly when wrong, and
reported in a run's stats."""

from __future__ import annotations

import pytest

import reasonkv
from conftest import tiny_llama
from reasonkv.cli import generate as cli_generate
from reasonkv.cli.main import build_parser


def _args(*extra):
    return build_parser().parse_args(["generate", "--prompt", "hi", "--policy", "snapkv", "-o", "window=4", *extra])


def test_generate_arguments_build_the_allocated_spec(tmp_path):
    spec = cli_generate.spec_from(_args("--budget", "32", "--allocation", "adaptive", "--adaptive-alpha", "0.5"))
    assert (spec.allocation, spec.adaptive_alpha, spec.ragged) == ("adaptive", 0.5, True)
    spec = cli_generate.spec_from(_args("--budget", "32", "--allocation", "pyramid", "--padded-heads"))
    assert (spec.allocation, spec.ragged) == ("pyramid", False)
    assert cli_generate.spec_from(_args("--budget", "32")).allocation == "uniform"
    with pytest.raises(ValueError, match="needs a budget file"):
        cli_generate.spec_from(_args("--budget", "32", "--allocation", "calibrated"))
    with pytest.raises(ValueError, match="cannot read the budget file"):
        cli_generate.spec_from(_args("--allocation", "calibrated", "--budgets-file", str(tmp_path / "none.json")))
    with pytest.raises(SystemExit):
        _args("--allocation", "even")


def test_a_runs_stats_carry_the_allocation():
    model = tiny_llama(layers=2)
    prompt = [5 + (7 * i) % 80 for i in range(40)]
    for allocation in ("uniform", "pyramid"):
        [result] = reasonkv.generate(
            model,
            None,
            [prompt],
            policy="streaming",
            budget=12,
            buffer=4,
            allocation=allocation,
            max_new_tokens=20,
            chat=False,
            ignore_eos=True,
        )
        assert result.stats["allocation"] == allocation and result.stats["evictions"] > 0
        # Held bytes are what the evicting layers hold (a ragged layer's regions), never above what is allocated.
        assert 0 < result.stats["peak_kv_bytes"] <= result.stats["peak_kv_bytes_allocated"]


def test_an_eviction_trace_under_an_allocation_carries_its_budgets():
    """(tests/budgets/test_inspect_allocation.py checks the trace against the cache at every eviction.)"""
    [result] = reasonkv.generate(
        tiny_llama(layers=2),
        None,
        [list(range(5, 45))],
        policy="streaming",
        budget=12,
        buffer=4,
        allocation="pyramid",
        trace=True,
        chat=False,
        max_new_tokens=8,
    )
    assert result.trace.settings["allocation"] == "pyramid" and int(result.trace.budgets.sum()) == 12 * 2 * 2
    assert len(result.trace.evictions) == result.stats["evictions"] >= 1


def test_a_selection_policy_under_an_allocation_is_refused_by_the_spec_before_a_model_loads():
    """One rule (CacheSpec): selection holds every token, so it has no budget to share among heads."""
    from reasonkv.cache import CacheSpec
    from reasonkv.cli import inspect as cli_inspect

    refusal = "allocation='pyramid' applies to evicting policies, not to 'quest' .it selects"
    with pytest.raises(ValueError, match=refusal):
        CacheSpec.build("quest", 64, allocation="pyramid")
    with pytest.raises(ValueError, match=refusal):
        CacheSpec.build("quest", 64).replace(allocation="pyramid")
    assert CacheSpec.build("quest", 64).allocation == "uniform"
    generate = ["generate", "--prompt", "hi", "--policy", "quest", "--budget", "64", "--allocation", "pyramid"]
    with pytest.raises(ValueError, match=refusal):
        cli_generate.spec_from(build_parser().parse_args(generate))
    inspect = ["inspect", "--prompt", "hi", "--policies", "h2o,quest", "--budget", "64", "--out", "x.html"]
    with pytest.raises(ValueError, match=refusal):
        cli_inspect.specs_from(build_parser().parse_args([*inspect, "--allocation", "pyramid"]))
