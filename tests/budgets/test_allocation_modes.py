"""A setting that does not apply to the chosen allocation is refused in one line, by the cache's spec, whatever
the entry point (the Python API, generate, inspect, eval's grid, bench): never run with the setting ignored."""

from __future__ import annotations

import re

import pytest

import reasonkv
from conftest import tiny_llama
from reasonkv.bench.settings import BenchSettings
from reasonkv.cache import CacheSpec
from reasonkv.cli import generate as cli_generate
from reasonkv.cli import inspect as cli_inspect
from reasonkv.cli.main import build_parser
from reasonkv.eval.grid import make_cells
from reasonkv.integrations.lm_eval_args import parse_model_args

OFF_MODE = [
    ("pyramid", {"adaptive_alpha": 0.5}, "adaptive_alpha=0.5 (--adaptive-alpha)", "allocation adaptive only"),
    ("uniform", {"adaptive_alpha": 0.2}, "adaptive_alpha=0.2 (--adaptive-alpha)", "allocation adaptive only"),
    ("adaptive", {"budgets_file": "b.json"}, "budgets_file='b.json' (--budgets-file)", "allocation calibrated only"),
    ("uniform", {"ragged": False}, "ragged=False (--padded-heads)", "allocations pyramid, adaptive, calibrated only"),
    ("uniform", {"ragged": True}, "ragged=True (--padded-heads)", "allocations pyramid, adaptive, calibrated only"),
]


@pytest.mark.parametrize(("allocation", "setting", "named", "applies"), OFF_MODE)
def test_the_spec_refuses_a_setting_off_its_allocation_naming_setting_value_mode_and_modes(
    allocation, setting, named, applies
):
    said = f"{named} does not apply to allocation {allocation!r}: it applies to {applies}"
    for policy in ("h2o", "full"):  # the full cache ignores the allocation, not a setting that contradicts it
        with pytest.raises(ValueError, match=re.escape(said)):
            CacheSpec.build(policy, 8, allocation=allocation, **setting)


def test_settings_of_their_own_allocation_are_kept_and_a_copy_stays_valid():
    adaptive = CacheSpec.build("h2o", 8, allocation="adaptive", adaptive_alpha=0.5)
    assert (adaptive.adaptive_alpha, adaptive.ragged) == (0.5, True)
    assert adaptive.replace(seed=3).adaptive_alpha == 0.5
    pyramid = CacheSpec.build("h2o", 8, allocation="pyramid", ragged=False)
    assert (pyramid.adaptive_alpha, pyramid.ragged) == (None, False)
    assert CacheSpec.build("h2o", 8, allocation="adaptive").adaptive_alpha == 0.2  # the default, where it applies
    uniform = CacheSpec.build("h2o", 8)
    assert (uniform.adaptive_alpha, uniform.ragged, uniform.budgets_file) == (None, None, None)
    # a copy under another allocation takes the settings that apply there, and refuses one given that does not
    assert adaptive.replace(allocation="uniform") == CacheSpec.build("h2o", 8)
    assert adaptive.replace(allocation="pyramid", ragged=False) == pyramid
    with pytest.raises(ValueError, match=re.escape("adaptive_alpha=0.5 (--adaptive-alpha) does not apply to")):
        adaptive.replace(allocation="pyramid", adaptive_alpha=0.5)
    full = CacheSpec.build("full", allocation="adaptive", adaptive_alpha=0.5)  # stored as the uniform full cache
    assert (full.allocation, full.adaptive_alpha, full.ragged) == ("uniform", None, None)
    assert full.replace(seed=1).allocation == "uniform"


def _cli(command: str, *extra: str):
    argv = [command, "--prompt", "hi", "--budget", "8"]
    argv += ["--policy", "h2o"] if command == "generate" else ["--policies", "h2o", "--out", "page.html"]
    return build_parser().parse_args([*argv, *extra])


@pytest.mark.parametrize(
    "extra",
    [
        ("--allocation", "pyramid", "--adaptive-alpha", "0.5"),
        ("--adaptive-alpha", "0.5"),
        ("--padded-heads",),
        ("--allocation", "pyramid", "--budgets-file", "b.json"),
    ],
    ids=" ".join,
)
def test_every_entry_point_refuses_it_before_the_model_loads(extra):
    flag = next(word for word in extra if word in ("--adaptive-alpha", "--padded-heads", "--budgets-file"))
    allocation = extra[1] if extra[0] == "--allocation" else "uniform"
    said = re.escape(f"({flag}) does not apply to allocation {allocation!r}")
    with pytest.raises(ValueError, match=said):
        cli_generate.spec_from(_cli("generate", *extra))
    with pytest.raises(ValueError, match=said):
        cli_inspect.specs_from(_cli("inspect", *extra))
    settings = dict(allocation=allocation, padded_heads="--padded-heads" in extra)
    settings.update(adaptive_alpha=0.5 if "--adaptive-alpha" in extra else None)
    settings.update(budgets_file="b.json" if "--budgets-file" in extra else None)
    with pytest.raises(ValueError, match=said):
        BenchSettings(out="o", policies=("h2o",), **settings)


def test_the_python_api_and_the_eval_grid_refuse_it_too():
    with pytest.raises(ValueError, match=re.escape("adaptive_alpha=0.5 (--adaptive-alpha) does not apply to")):
        reasonkv.generate(
            tiny_llama(layers=2), None, [[5, 6, 7]], policy="h2o", budget=8, allocation="pyramid", adaptive_alpha=0.5
        )
    with pytest.raises(ValueError, match=re.escape("budgets_file='b.json' (--budgets-file) does not apply to")):
        make_cells(["h2o"], [16], 4, allocations="uniform,pyramid", budgets_file="b.json")
    # lm-eval's model builds its spec as the commands do: the same refusal, in the same words
    with pytest.raises(ValueError, match=re.escape("model_args: adaptive_alpha=0.5 (--adaptive-alpha) does not apply")):
        parse_model_args({"policy": "h2o", "budget": 8, "adaptive_alpha": 0.5})
