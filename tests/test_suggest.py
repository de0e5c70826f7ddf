"""Did-you-mean: a typo of a policy, a policy option, a dataset or a model name is answered by the likely name
first, and the message still names the bad value and every allowed one."""

from __future__ import annotations

import pytest

from reasonkv.cli import main
from reasonkv.eval.datasets import DATASETS, dataset_path, load_dataset
from reasonkv.models import load_model
from reasonkv.policies import get_policy, list_policies, options_by_policy, parse_options
from reasonkv.suggest import close_matches, did_you_mean


def test_the_close_names_come_best_first_without_case_and_none_when_nothing_is_close():
    assert did_you_mean("h2p", list_policies()) == "did you mean 'h2o'? "
    assert close_matches("SNAPKV2", ["snapkv", "streaming"]) == ["snapkv"]
    assert sorted(close_matches("aime", ["aime24", "aime25", "gsm8k"])) == ["aime24", "aime25"]  # a tie: both
    assert did_you_mean("nope", list_policies()) == ""
    assert did_you_mean("h2o", ["h2o"]) == ""  # the name itself is no suggestion
    assert did_you_mean(None, ["h2o"]) == did_you_mean("", ["h2o"]) == ""


def test_a_policy_name(capsys):
    with pytest.raises(ValueError) as info:
        get_policy("h2p")
    message = str(info.value)
    assert message.startswith("unknown policy 'h2p'; did you mean 'h2o'? valid policies: ")
    assert all(name in message for name in list_policies())
    assert main(["generate", "--prompt", "x", "--policy", "streamin"]) == 2  # refused before any model loads
    assert "unknown policy 'streamin'; did you mean 'streaming'? valid policies: curdkv" in capsys.readouterr().err


def test_a_policy_option():
    with pytest.raises(ValueError, match="no option 'sink'; did you mean 'sinks'\\? options: protect_prompt, sinks"):
        parse_options("streaming", ["sink=4"])
    with pytest.raises(ValueError, match="has no option 'windw'; did you mean 'window'\\? options: "):
        get_policy("streaming", windw=8)
    with pytest.raises(ValueError, match="no selected policy has an option 'sink'; did you mean 'sinks'\\? "):
        options_by_policy(["h2o", "snapkv"], ["sink=4"])
    with pytest.raises(ValueError, match="policy 'streaming' has no option 'zzz'; options: protect_prompt"):
        parse_options("streaming", ["zzz=1"])


def test_a_dataset_name():
    with pytest.raises(ValueError) as info:
        load_dataset("gsm8")
    message = str(info.value)
    assert message.startswith("unknown dataset 'gsm8'; did you mean 'gsm8k'? known names: ")
    assert all(name in message for name in DATASETS)
    with pytest.raises(ValueError, match="unknown dataset 'math50'; did you mean 'math500'\\? known names: "):
        dataset_path("math50")
    with pytest.raises(ValueError, match="unknown dataset 'nope'; known names: "):
        load_dataset("nope")


@pytest.mark.parametrize(
    "name, meant",
    [("smollm2 135m", "smollm2-135m"), ("gemma3 270m", "gemma3-270m"), ("shape:llama3.1-8b", "llama-3.1-8b")],
)
def test_a_model_name(name, meant):
    # Names with a space are no hub id, so nothing is looked up: the error comes at once, with the likely name.
    with pytest.raises(ValueError) as info:
        load_model(name)
    message = str(info.value)
    assert f"did you mean '{meant}'?" in message and repr(name.removeprefix("shape:")) in message
    assert "smollm2-135m" in message or "available shapes: " in message
