"""lm-eval's --model_args for the reasonkv model: typed like the command line's -o, refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reasonkv.cache.spec import DEFAULT_BUFFER, CacheSpec, resolve_spec
from reasonkv.integrations.lm_eval_args import parse_model_args
from reasonkv.policies import parse_options


def test_cache_settings_and_policy_options_build_the_spec():
    # as lm-eval's parser types them: numbers as numbers, a list from [1,2], text elsewhere
    args = parse_model_args(
        {"pretrained": "smollm2-135m", "policy": "epikv", "budget": 64, "buffer": "16", "policy.band_a": [3, 9]}
    )
    assert args.spec == CacheSpec.build("epikv", 64, 16, band_a=(3, 9))
    assert args.pretrained == "smollm2-135m" and args.scoring == "evicting" and args.batch_size == 1


def test_policy_options_are_parsed_by_the_command_lines_parser():
    for key, value in [("sinks", 8), ("window", "16"), ("protect_prompt", True), ("protect_prompt", "false")]:
        spec = parse_model_args({"policy": "streaming", "budget": 64, f"policy.{key}": value}).spec
        text = str(value).lower()
        expected = parse_options("streaming", [f"{key}={text}"])[key]
        assert getattr(spec.policy, key) == expected, key
    # POLICY.KEY names the selected policy
    spec = parse_model_args({"policy": "h2o", "budget": 64, "h2o.sinks": 2}).spec
    assert spec.policy.sinks == 2


def test_defaults_are_the_full_cache_and_reasonkvs_buffer():
    args = parse_model_args({})
    assert args.spec.policy.name == "full" and args.spec.budget is None and args.spec.buffer == DEFAULT_BUFFER
    assert args.pretrained == "smollm2-135m" and args.dtype == "fp32" and args.device is None


def test_lm_evals_own_settings_pass_through_and_unknown_ones_are_refused():
    args = parse_model_args({"batch_size": "4", "max_length": 2048, "max_batch_size": 64, "add_bos_token": True})
    assert args.batch_size == 4 and args.harness == {"max_length": 2048, "add_bos_token": True}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"policy": "nope", "budget": 64}, "model_args policy='nope': unknown policy 'nope'; valid policies: "),
        ({"policy": "streaming", "budget": 2}, "model_args: streaming: sinks (4) + window (0) = 4 protected tokens"),
        ({"policy": "streaming", "budget": 64, "policy.snks": 8}, "model_args policy.snks=8: policy 'streaming' has"),
        ({"policy": "streaming"}, "model_args: policy 'streaming' needs a budget"),
        ({"policy": "streaming", "budget": "lots"}, "model_args budget='lots': expected an integer or none"),
        ({"policy": "h2o", "budget": 64, "streaming.sinks": 8}, "names policy 'streaming', which is not selected"),
        ({"policy": "streaming", "budget": 64, "policy.protect_prompt": "maybe"}, "protect_prompt='maybe': expected"),
        ({"budgt": 64}, "model_args budgt=64: unknown argument; reasonkv's model takes"),
        ({"policy": "streaming", "budget": 64, "sinks": 8}, "(a policy option? write policy.sinks=8)"),
        ({"scoring": "half"}, "model_args scoring='half': expected 'evicting'"),
        ({"batch_size": "auto"}, "model_args batch_size='auto': expected a positive integer"),
        ({"pretrained": object()}, "needs its tokenizer= too"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_argument(args, message):
    with pytest.raises(ValueError) as caught:
        parse_model_args(args)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_allocation_builds_the_spec_as_the_command_line_does():
    args = {"policy": "h2o", "budget": 64, "buffer": 16, "allocation": "adaptive", "adaptive_alpha": "0.5"}
    spec = parse_model_args({**args, "padded_heads": "true"}).spec
    assert spec == resolve_spec(None, policy="h2o", budget=64, buffer=16, allocation="adaptive", adaptive_alpha=0.5,
                                ragged=False)  # fmt: skip
    assert (spec.allocation, spec.adaptive_alpha, spec.ragged) == ("adaptive", 0.5, False)
    assert parse_model_args({"policy": "h2o", "budget": 64, "allocation": "pyramid"}).spec.allocation == "pyramid"
    assert parse_model_args({"policy": "h2o", "budget": 64}).spec == CacheSpec.build("h2o", 64)  # uniform


@pytest.mark.parametrize("allocation", [{"allocation": "even"}, {"allocation": "pyramid", "adaptive_alpha": 0.3}])
def test_an_allocation_the_spec_refuses_is_refused_in_the_specs_words(allocation):
    with pytest.raises(ValueError) as refused:
        resolve_spec(None, policy="h2o", budget=64, **allocation)
    with pytest.raises(ValueError) as caught:
        parse_model_args({"policy": "h2o", "budget": 64, **allocation})
    assert str(caught.value) == f"model_args: {refused.value}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"allocation": "adaptive", "adaptive_alpha": "lots"}, "model_args adaptive_alpha='lots': expected a number"),
        ({"padded_heads": "maybe"}, "model_args padded_heads='maybe': expected true or false"),
    ],
)
def test_an_allocation_value_of_the_wrong_type_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        parse_model_args({"policy": "h2o", "budget": 64, **args})


def test_the_results_config_names_an_allocation_other_than_uniform():
    pytest.importorskip("lm_eval")
    from reasonkv.integrations.lm_eval import ReasonKVLM

    def settings(**cache):
        spec = parse_model_args({"policy": "h2o", "budget": 64, **cache}).spec
        return ReasonKVLM.settings.fget(SimpleNamespace(spec=spec, pretrained="m", scoring="evicting"))

    assert "allocation" not in settings()  # as before allocations
    assert {k: settings(allocation="adaptive", adaptive_alpha=0.5)[k] for k in ("allocation", "adaptive_alpha")} == {
        "allocation": "adaptive",
        "adaptive_alpha": 0.5,
    }
