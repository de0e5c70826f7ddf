"""Policy options: one typed parser for every command, strict types in Python, state per cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies import Policy, get_policy, list_policies, options_by_policy, parse_options, policy_class
from reasonkv.policies.options import field_types


def test_text_is_parsed_by_the_field_type():
    assert parse_options("raas", ["protect_prompt=False", "threshold=0.01", "sinks=8"]) == {
        "protect_prompt": False,
        "threshold": 0.01,
        "sinks": 8,
    }
    assert parse_options("epikv", ["band_a=1,2,3", "a=none", "calibration=runs/x.json"]) == {
        "band_a": (1, 2, 3),
        "a": None,
        "calibration": "runs/x.json",
    }
    assert parse_options("thinkv", ["thresholds=0.2,0.6", "trigger=none"]) == {
        "thresholds": (0.2, 0.6),
        "trigger": None,
    }
    assert parse_options("vase-attnv", ["reserve=64"]) == {"reserve": 64}  # a count stays an int
    assert parse_options("vase-attnv", ["reserve=0.25"]) == {"reserve": 0.25}


@pytest.mark.parametrize(
    "pair, message",
    [
        ("protect_prompt=maybe", r"raas: option protect_prompt='maybe': expected bool"),
        ("threshold=high", r"raas: option threshold='high': expected float"),
        ("sinks=2.5", r"raas: option sinks='2.5': expected int"),
        ("sinks", "is not KEY=VALUE"),
        ("treshold=0.1", "policy 'raas' has no option 'treshold'"),
    ],
)
def test_text_that_does_not_parse_is_refused(pair, message):
    with pytest.raises(ValueError, match=message):
        parse_options("raas", [pair])


@pytest.mark.parametrize("value", ["False", "false", 0, 1.0, None])
def test_python_values_must_have_the_field_type(value):
    """A string (or any non-bool) is never taken as truthy."""
    with pytest.raises(ValueError, match="protect_prompt"):
        get_policy("raas", protect_prompt=value)
    with pytest.raises(ValueError, match="protect_prompt"):
        get_policy("streaming", protect_prompt=value)


class _Opaque:
    """A value of no option's type."""

    def __repr__(self) -> str:
        return "<opaque>"


@pytest.mark.parametrize("name", list_policies())
def test_every_option_is_typed_however_the_policy_is_made(name):
    """The type check runs on construction (``Policy.__post_init__``), before any range check, so a
    wrong type is refused by the class itself, by ``get_policy`` and by ``dataclasses.replace``."""
    cls = policy_class(name)
    types = field_types(cls)
    assert Any not in types.values(), f"{name}: an annotation does not resolve"
    for option in types:
        message = rf"^{name}: option {option}=<opaque>: expected "
        with pytest.raises(ValueError, match=message):
            cls(**{option: _Opaque()})
        with pytest.raises(ValueError, match=message):
            get_policy(name, **{option: _Opaque()})
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cls(), **{option: _Opaque()})


@dataclass
class _Unchecked(Policy):
    """Test-only: options that no check of the policy's own looks at."""

    name = "test-unchecked"
    flag: bool = False
    layers: tuple[int, ...] | None = None

    def score(self, view):
        return view.token_positions().float()


def test_fields_without_their_own_check_are_typed_too():
    with pytest.raises(ValueError, match=r"test-unchecked: option flag='no': expected bool"):
        get_policy(_Unchecked(flag="no"))
    with pytest.raises(ValueError, match=r"option layers=\('1', 2\): expected tuple\[int, \.\.\.\] or None"):
        get_policy(_Unchecked(), layers=("1", 2))
    assert get_policy(_Unchecked(), layers=[1, 2]).layers == [1, 2]  # a list of ints is a sequence of ints


def test_one_syntax_for_several_policies():
    options = options_by_policy(["full", "streaming", "h2o"], ["sinks=8", "h2o.recent_ratio=0.25"])
    assert options == {"full": {}, "streaming": {"sinks": 8}, "h2o": {"sinks": 8, "recent_ratio": 0.25}}
    with pytest.raises(ValueError, match="names policy 'tova', which is not selected"):
        options_by_policy(["streaming"], ["tova.layerwise=false"])
    with pytest.raises(ValueError, match="no selected policy has an option 'layerwise'"):
        options_by_policy(["streaming", "h2o"], ["layerwise=false"])


def test_the_old_colon_spelling_still_works_with_a_warning():
    with pytest.warns(FutureWarning, match=r"POLICY:KEY is deprecated, write h2o.recent_ratio"):
        options = options_by_policy(["streaming", "h2o"], ["h2o:recent_ratio=0.25"])
    assert options["h2o"] == {"recent_ratio": 0.25}


def test_get_policy_always_returns_a_fresh_instance():
    policy = get_policy("h2o", recent_ratio=0.25)
    copy = get_policy(policy)
    assert copy is not policy and copy == policy
    assert get_policy(policy, sinks=2).sinks == 2 and policy.sinks == 4


@torch.inference_mode()
def test_one_policy_instance_given_to_two_caches_shares_no_state():
    model = tiny_llama()
    policy = get_policy("h2o")
    prompt = torch.tensor([[3 + i % 80 for i in range(30)]])
    key = cache_keyword(model)

    def run(cache):
        out = model(input_ids=prompt, **{key: cache})
        for _ in range(12):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
        return [cache.positions(layer).clone() for layer in range(3)], out.logits

    with reasonkv.EvictingCache(12, 4, model=model, policy="h2o") as fresh:
        alone = run(fresh)
    with (
        reasonkv.EvictingCache(12, 4, model=model, policy=policy) as first,
        reasonkv.EvictingCache(12, 4, model=model, policy=policy) as second,
    ):
        assert first.evictor.policy is not policy and second.evictor.policy is not first.evictor.policy
        in_first = run(first)
        in_second = run(second)  # would differ if the first run's accumulated scores leaked
    for got in (in_first, in_second):
        assert all(torch.equal(a, b) for a, b in zip(got[0], alone[0], strict=True))
        assert torch.equal(got[1], alone[1])
    assert policy.accumulated is None  # the instance itself stays configuration
