"""What the decoding commands check before they decode, and what they say while they do: the model's context
(as eval checks it), the output paths, a line per run, and ``eval --plan``'s time estimate."""

from __future__ import annotations

import json
import warnings

import pytest

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.cli import main
from reasonkv.generation.context import check_context, context_length

CONTEXT = "exceed the model's context of 1,024 tokens (max_position_embeddings)"


def _tiny(monkeypatch, command: str) -> None:
    """``command`` loads the tiny model (context 1,024) with a character tokenizer instead of a real one."""
    monkeypatch.setattr(f"reasonkv.cli.{command}.load_model_from", lambda args: (tiny_llama(), NoEosTokenizer()))


def _never_decodes(monkeypatch, where: str) -> None:
    monkeypatch.setattr(where, lambda *a, **k: pytest.fail("decoding started"))


def _error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_prompt_and_its_tokens_past_the_context_are_refused_with_the_numbers():
    model = tiny_llama()
    assert context_length(model) == 1024
    check_context(model, [[5] * 1000], 24)  # 1,024: fits exactly
    with pytest.raises(ValueError) as info:
        check_context(model, [[5] * 10, [5] * 1000], 25)
    assert str(info.value) == (
        "checked before decoding: prompt 2 of 2: the prompt (1,000 tokens) and up to 25 new tokens (1,025) "
        f"{CONTEXT}; shorten the prompt or lower --max-new-tokens"
    )


def test_the_api_warns_past_the_context_and_decodes_what_it_is_asked():
    model = tiny_llama()
    with pytest.warns(UserWarning, match=f"reasonkv.generate: the prompt \\(1,000 tokens\\).* {CONTEXT[:30]}"):
        [result] = reasonkv.generate(model, None, [[5] * 1000], max_new_tokens=25)
    assert result.num_tokens == 25
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [inside] = reasonkv.generate(model, None, [[5] * 1000], max_new_tokens=24)  # fits: no warning
    assert "past_context" not in inside.stats


def test_a_row_decoded_past_the_context_says_so_in_its_stats():
    """The warning is for the call; each row's stats record whether that row's tokens did run past the context."""
    with pytest.warns(UserWarning, match="exceed the model's context"):
        long, short = reasonkv.generate(tiny_llama(), None, [[5] * 1000, [5] * 10], max_new_tokens=30, ignore_eos=True)
    assert long.stats["past_context"] == {"context": 1024, "tokens": 1030}
    assert "past_context" not in short.stats


@pytest.mark.parametrize(
    "command, argv, decoder",
    [
        ("generate", ["generate", "--prompt", "x" * 1000, "--max-new-tokens", "25"], "reasonkv.cli.generate.generate"),
        ("demo", ["demo", "--prompt", "x" * 1000, "--max-new-tokens", "25"], "reasonkv.cli.demo.generate"),
        (
            "inspect",
            ["inspect", "--prompt", "x" * 1000, "--max-new-tokens", "25"],
            "reasonkv.cli.inspect.inspect_prompt",
        ),
    ],
)
def test_the_commands_refuse_a_prompt_past_the_context_before_decoding(
    command, argv, decoder, capsys, monkeypatch, tmp_path
):
    _tiny(monkeypatch, command)
    _never_decodes(monkeypatch, decoder)
    out = ["--out", str(tmp_path / "page.html")] if command == "inspect" else []
    assert main([*argv, *out]) == 2
    line = _error(capsys)
    assert "the prompt (1,000 tokens) and up to 25 new tokens (1,025)" in line and CONTEXT in line


def test_inspect_checks_its_outputs_before_the_model_loads(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: pytest.fail("the model was loaded"))
    missing = tmp_path / "no" / "such"
    foreign = tmp_path / "mine.html"
    foreign.write_text("<p>my own page</p>", encoding="utf-8")
    folder = tmp_path / "pages.html"
    folder.mkdir()
    base = ["inspect", "--prompt", "What is 2 + 3?", "--out"]
    for argv, said in (
        ([*base, str(missing / "page.html")], f"--out {missing / 'page.html'}: the folder {missing} does not exist"),
        ([*base, str(folder)], f"--out {folder} is a folder: name a file"),
        ([*base, str(foreign)], f"{foreign} exists and is not a page reasonkv inspect wrote"),
        ([*base, str(tmp_path / "p.html"), "--png", str(missing / "p.png")], f"--png {missing / 'p.png'}: the folder"),
        ([*base, str(tmp_path / "p.html"), "--save-trace", str(foreign / "t.npz")], f"{foreign} is a file, not a"),
    ):
        assert main(argv) == 2
        assert said in _error(capsys)
    assert foreign.read_text(encoding="utf-8") == "<p>my own page</p>" and not (tmp_path / "no").exists()


def test_an_output_folder_where_no_file_can_be_created_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """/sys exists but takes no new file, even from root (whom permission bits never stop): the folder is tested by
    creating and removing a file there, and the probe leaves nothing behind in a folder that can be written."""
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: pytest.fail("the model was loaded"))
    base = ["inspect", "--prompt", "What is 2 + 3?", "--out"]
    for argv, said in (
        ([*base, "/sys/page.html"], "--out /sys/page.html: cannot create a file in the folder /sys ("),
        ([*base, str(tmp_path / "p.html"), "--png", "/sys/p.png"], "--png /sys/p.png: cannot create a file in"),
    ):
        assert main(argv) == 2
        assert said in _error(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [{"id": "p1", "problem": "2+2?", "answer": "4"}, {"id": "p2", "problem": "3+3?", "answer": "6"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_eval_makes_its_results_folder_but_not_a_tree_of_missing_ones(problems, capsys, tmp_path):
    argv = ["eval", "--model", "no-such-model", "--dataset", str(problems), "--policies", "full", "--no-progress"]
    deep = tmp_path / "no" / "dir" / "r.jsonl"
    assert main([*argv, "--out", str(deep)]) == 2
    folder = tmp_path / "no" / "dir"
    assert f"--out {deep}: the folder {folder} does not exist, nor {folder.parent} above it" in _error(capsys)
    assert not (tmp_path / "no").exists()
    assert main([*argv, "--out", str(tmp_path / "runs" / "r.jsonl")]) == 2  # refused later: the model
    assert "no-such-model" in capsys.readouterr().err and (tmp_path / "runs").is_dir()


def test_demo_and_inspect_say_which_run_they_decode(capsys, monkeypatch, tmp_path):
    _tiny(monkeypatch, "demo")
    assert main(["demo", "--budget", "8", "--buffer", "4", "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "[1/2] full: decoding up to 6 new tokens ..." in err and "[2/2] h2o: decoding up to 6 new tokens ..." in err
    assert any(line.startswith("[2/2] h2o: 6 tokens (length), ") and line.endswith(" s") for line in err)

    _tiny(monkeypatch, "inspect")
    page = tmp_path / "page.html"
    argv = ["inspect", "--prompt", "a prompt of some length", "--policies", "h2o,streaming", "--out", str(page)]
    assert main([*argv, "--budget", "8", "--buffer", "4", "--max-new-tokens", "12"]) == 0
    err = capsys.readouterr().err.splitlines()
    starts = [line for line in err if line.endswith("decoding up to 12 new tokens ...")]
    assert starts == [
        f"[{i}/3] {name}: decoding up to 12 new tokens ..." for i, name in enumerate(("full", "h2o", "streaming"), 1)
    ]
    assert any(line.startswith("[3/3] streaming: 12 tokens (length), ") and "evictions" in line for line in err)
    assert page.is_file()


def test_the_plan_estimates_the_time_from_a_measured_speed(problems, capsys):
    argv = ["eval", "--dataset", str(problems), "--policies", "full,streaming", "--budgets", "64", "--plan"]
    assert main([*argv, "--max-new-tokens", "100", "--tokens-per-second", "50"]) == 0
    out = capsys.readouterr().out
    assert "4 generation units (at most 400 new tokens" in out
    assert "time: at most 8 s: 400 decode steps" in out and "at 50 tok/s (--tokens-per-second, as measured)" in out
    assert main([*argv, "--max-new-tokens", "3000", "--tokens-per-second", "2.5"]) == 0
    assert "time: at most 1 h 20 min: 12,000 decode steps" in capsys.readouterr().out
    assert main([*argv, "--max-new-tokens", "100"]) == 0
    assert "pass --tokens-per-second N, measured on this machine, for an estimate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--tokens-per-second", "0"])
    assert "--tokens-per-second: expected a positive number of tokens per second, got '0'" in _error(capsys)
    assert main(["eval", "--dataset", str(problems), "--tokens-per-second", "50"]) == 2
    assert "--tokens-per-second is for the time estimate of --plan" in capsys.readouterr().err
