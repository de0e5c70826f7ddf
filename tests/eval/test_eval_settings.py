"""``reasonkv eval``'s flags are the fields of EvalSettings: parsed and read back, they build the grid Python builds."""

from __future__ import annotations

import argparse

import pytest

from reasonkv.cli.eval import add_arguments, settings_from
from reasonkv.eval.grid import GridSpec
from reasonkv.eval.settings import EvalSettings


def _parsed(*argv: str) -> EvalSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from(parser.parse_args(["--dataset", "gsm8k:2", *argv]))


def test_the_defaults_of_the_flags_are_the_fields_defaults():
    assert _parsed().grid() == EvalSettings(dataset="gsm8k:2").grid() == GridSpec.build(dataset="gsm8k:2")
    assert _parsed().progress and _parsed("--no-progress").progress is False


def test_each_flag_reaches_the_grid():
    argv = ["--policies", "full,streaming", "--budgets", "16,32", "--buffer", "4", "-o", "sinks=2"]
    argv += ["--fidelity-only", "--thinking", "off", "--samples", "3", "--temperature", "0.5", "--seed", "7"]
    grid = _parsed(*argv, "--trace-problems", "a,b", "--fidelity-tokens", "5").grid()
    expected = GridSpec.build(
        dataset="gsm8k:2", policies="full,streaming", budgets=[16, 32], buffer=4, options=["sinks=2"],
        generation=False, thinking=False, samples=3, temperature=0.5, seed=7, trace_problems="a,b",
        fidelity_tokens=5,
    )  # fmt: skip
    assert grid == expected and not grid.generation and grid.fidelity and grid.thinking is False
    assert _parsed("--fidelity").grid().fidelity is True and _parsed("--no-fidelity").grid().fidelity is False


def test_a_bad_value_is_refused_by_the_parser_naming_it(capsys):
    with pytest.raises(SystemExit):
        _parsed("--budgets", "16,x")
    assert "expected comma-separated integers, got '16,x'" in capsys.readouterr().err
