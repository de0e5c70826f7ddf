"""Command line: argument handling and errors (no model needed)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reasonkv.cli.demo import DEFAULT_POLICY
from reasonkv.cli.main import COMMANDS, main
from reasonkv.policies import list_policies, parse_options, policy_class
from reasonkv.policies.option_docs import option_meanings

SRC = Path(__file__).resolve().parents[1] / "src"


def test_policies_lists_every_policy_and_what_each_option_does(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "streaming [token]" in out and "-o sinks=4" in out
    assert "-o pending='recent'      What pending (not yet finalised) lag tokens score at eviction." in out
    assert "-o quota=True" in out and "-o retain='last'" in out
    for name in list_policies():  # every option of every policy says what it does, from the policy's docstring
        meanings = option_meanings(policy_class(name))
        assert all(meanings.get(option) for option in policy_class(name).options()), name


def test_policies_describes_one_policy(capsys):
    assert main(["policies", "snapkv"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("snapkv [head]") and "streaming" not in out
    assert (
        "-o kernel=7              Width of the pooling along the slots (default 7, SnapKV's; odd; 1 = no pooling)."
        in out
    )
    assert main(["policies", "snapkv", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["options"]["query_window"] == 32 and data["meanings"]["query_window"].startswith("w, how many")
    assert main(["policies", "snap"]) == 2
    assert "unknown policy 'snap'; did you mean 'snapkv'? valid policies: curdkv" in error_line(capsys)


def test_an_entry_shared_by_several_options_keeps_each_ones_own_meaning():
    # rkv documents sinks, window and protect_prompt together (a remark on defaults), window on its own
    meanings = option_meanings(policy_class("rkv"))
    assert meanings["sinks"] == "The first sinks logical positions are never evicted (they count against the budget)."
    assert meanings["window"].startswith("Protected recent tokens.")


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


def error_line(capsys) -> str:
    """The one line a user error prints (after, at most, the line announcing the model load)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_errors_exit_with_a_message(capsys, tmp_path):
    assert main(["generate", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "prompt file not found" in error_line(capsys)
    assert main(["generate", "--prompt", "x", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'; valid policies:" in error_line(capsys)
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in error_line(capsys)
    assert main(["generate", "--prompt", "x", "--bits", "4"]) == 2  # refused before any model loads
    assert "bits=4 has no effect without a quantized tier" in error_line(capsys)
    for bad in (["--bits", "3"], ["--quantized", "-1"], ["--quantized", "two"]):
        with pytest.raises(SystemExit) as exited:
            main(["generate", "--prompt", "x", *bad])
        line = error_line(capsys)  # one line, as for every user error: no usage block
        assert exited.value.code == 2 and line.startswith("reasonkv generate: error: argument --")
        assert line.endswith("(see reasonkv generate --help)")


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["eval", "--budgets", "x"], "reasonkv eval: error: argument --budgets: expected comma-separated integers"),
        ([], "reasonkv: error: the following arguments are required: COMMAND"),
        (["evaluate"], "reasonkv: error: argument COMMAND: invalid choice: 'evaluate'"),
        (["report"], "reasonkv report: error: the following arguments are required: results"),
    ],
)
def test_argument_errors_are_one_line(capsys, argv, start):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and error_line(capsys).startswith(start)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stop", ""], "stop strings must not be empty: '' would end every row at its first token"),
        (["--temperature", "nan"], "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        (["--top-p", "inf"], "top_p must be a number in (0, 1], got inf"),
        (["--top-k", "-3"], "top_k must be a non-negative integer (0 = off), got -3"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer, got 0"),
    ],
)
def test_bad_generation_settings_are_refused_before_the_model_loads(args, message, capsys, monkeypatch):
    monkeypatch.setattr("reasonkv.cli.generate.load_model_from", lambda args: pytest.fail("the model was loaded"))
    assert main(["generate", "--prompt", "x", *args]) == 2
    assert error_line(capsys) == f"reasonkv generate: error: {message}"


def test_demo_refuses_bad_settings_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("reasonkv.cli.demo.load_model_from", lambda args: pytest.fail("the model was loaded"))
    assert main(["demo", "--max-new-tokens", "-1"]) == 2
    assert "max_new_tokens must be a positive integer, got -1" in error_line(capsys)


def test_prompt_file_that_is_not_text(capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert main(["generate", "--prompt-file", str(path)]) == 2
    assert error_line(capsys) == f"reasonkv generate: error: prompt file {path} is not UTF-8 text"
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert "is a directory, not a file" in error_line(capsys)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_attention_implementation_not_installed(capsys):
    assert main(["generate", "--prompt", "x", "--attn", "flash_attention_2"]) == 2
    assert "needs the flash_attn package, which is not installed" in error_line(capsys)


def test_damaged_model_files_are_one_line(capsys, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"<html>a login page saved instead of the model</html>")
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "model.gguf")]) == 2
    assert "is not a GGUF file: it starts with b'<htm'" in error_line(capsys)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama", ')
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "ckpt")]) == 2
    assert "config.json" in error_line(capsys)


def test_out_of_memory_names_what_to_lower(capsys, monkeypatch):
    def run(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.5 GiB free.")

    monkeypatch.setattr("reasonkv.cli.generate.run", run)
    assert main(["generate", "--prompt", "x"]) == 2
    assert error_line(capsys) == (
        "reasonkv generate: error: out of memory (tried to allocate 2.00 GiB); lower the number of prompts or "
        "--max-new-tokens, or use --dtype bf16 or a smaller --model"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limits as on Linux")
@pytest.mark.slow
def test_a_model_too_large_for_memory_is_one_line():
    """A real allocation failure, in a process whose memory is limited: one line, exit 2, no traceback."""
    limit = 1_500_000_000  # bytes of address space: enough for torch, far too little for 14B parameters
    command = [sys.executable, "-m", "reasonkv.cli", "generate", "--model", "shape:qwen3-14b", "--prompt", "x"]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(
        "reasonkv generate: error: out of memory (tried to allocate 2.9 GiB); lower the number of prompts"
    )


@pytest.mark.parametrize(
    "bug",
    [
        TypeError("unsupported operand"),
        ImportError("cannot import name 'gone' from 'reasonkv.generation.loop'", name="reasonkv.generation.loop"),
    ],
)
def test_a_bug_keeps_its_traceback(bug, monkeypatch):
    def run(args):
        raise bug  # not the user's doing

    monkeypatch.setattr("reasonkv.cli.generate.run", run)
    with pytest.raises(type(bug), match=str(bug)):
        main(["generate", "--prompt", "x"])


@pytest.mark.parametrize("argv", [["--debug", "generate"], ["generate", "--debug"]])
def test_debug_shows_the_traceback_of_user_errors(argv, tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        main([*argv, "--prompt-file", str(tmp_path / "missing.txt")])


def test_missing_dependencies_are_named_at_start_up(capsys, monkeypatch):
    declared = ["torch>=2.4", "reasonkv-no-such-package>=1.2", "pytest>=8; extra == 'test'"]
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: declared if name == "reasonkv" else None)
    monkeypatch.setattr("reasonkv.cli.policies.run", lambda args: pytest.fail("ran without its dependencies"))
    assert main(["policies"]) == 2
    assert error_line(capsys) == (
        "reasonkv policies: error: reasonkv's dependencies are not all installed; "
        "pip install 'reasonkv-no-such-package>=1.2'"
    )


def test_a_command_whose_package_is_missing_says_what_to_install(capsys, monkeypatch, tmp_path):
    (tmp_path / "needs_a_package.py").write_text("import reasonkv_no_such_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "plot", ("needs_a_package", "a command whose dependency is not installed"))
    assert main(["plot", "--any", "arguments"]) == 2
    assert error_line(capsys).startswith(
        "reasonkv plot: error: the Python package 'reasonkv_no_such_package' is not installed"
    )


def test_unwritable_output_is_one_line(capsys, tmp_path):
    results = tmp_path / "results.jsonl"
    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "results.jsonl"
    results.write_text("".join(committed.read_text(encoding="utf-8").splitlines(keepends=True)[:20]))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["report", str(results), "--out", str(blocker / "report")]) == 2
    assert str(blocker) in error_line(capsys)
    assert blocker.read_text() == "not a directory"


def test_a_default_that_differs_between_commands_says_why(capsys):
    for command, default in (
        ("bench", "bf16: speed is measured in the dtype models are served in"),
        ("eval", "fp32: exact on any device"),
        ("generate", "fp32: exact on any device"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert f"(default {default})" in " ".join(capsys.readouterr().out.split())


def test_the_demo_default_is_the_policy_closest_to_the_full_cache_in_the_committed_results():
    summary = json.loads((Path(__file__).resolve().parents[1] / "docs/results/summary.json").read_text())
    for dataset in ("gsm8k", "math500"):  # at the smaller budget, where the policies differ
        rows = [r for r in summary if r["section"]["dataset"] == dataset and r["budget"] == 128]
        assert max(rows, key=lambda r: r["top1_agreement"])["policy"] == DEFAULT_POLICY
