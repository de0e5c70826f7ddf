"""Command line: argument handling and errors (no model needed)."""

from __future__ import annotations

import pytest

from reasonkv.cli import main
from reasonkv.policies import parse_options


def test_policies_lists_every_policy(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "streaming" in out and "options: sinks=4" in out


def test_option_parsing_converts_types():
    assert parse_options("streaming", ["sinks=8", "protect_prompt=true", "window=0"]) == {
        "sinks": 8,
        "protect_prompt": True,
        "window": 0,
    }


@pytest.mark.parametrize(
    "pairs, message",
    [
        (["sinks"], "is not KEY=VALUE"),
        (["sink=3"], "policy 'streaming' has no option 'sink'"),
        (["sinks=many"], "option sinks='many': expected int"),
        (["protect_prompt=maybe"], "expected bool"),
    ],
)
def test_bad_options_are_clear_errors(pairs, message):
    with pytest.raises(ValueError, match=message):
        parse_options("streaming", pairs)


def test_errors_exit_with_a_message(capsys, tmp_path):
    assert main(["generate", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'; valid policies:" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--bits", "4"]) == 2  # refused before any model loads
    assert "bits=4 has no effect without a quantized tier" in capsys.readouterr().err
    for bad in (["--bits", "3"], ["--quantized", "-1"], ["--quantized", "two"]):
        with pytest.raises(SystemExit):
            main(["generate", "--prompt", "x", *bad])
        err = capsys.readouterr().err
        assert "argument --bits" in err or "argument --quantized" in err
