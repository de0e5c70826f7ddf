"""``reasonkv calibrate --gates``: the command line's settings, and a whole run on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from conftest import tiny_llama
from reasonkv.calibrate import gates as gates_module
from reasonkv.calibrate.gates import GatesSettings, run_gates
from reasonkv.cli import calibrate as cli_calibrate
from reasonkv.selection.gatefile import load_gate


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    cli_calibrate.add_arguments(parser)
    return parser.parse_args(["--gates", "--out", str(tmp_path / "gates"), *extra])


def test_settings_from_the_command_line(tmp_path):
    settings = cli_calibrate.settings_from(
        _args(tmp_path, "--gate-traces", "5", "--gate-steps", "7", "--gate-dim", "8")
    )
    assert isinstance(settings, GatesSettings)
    assert (settings.traces, settings.steps, settings.gate_dim, settings.block_size) == (5, 7, 8, 64)
    assert "--gates" in settings.command()
    with pytest.raises(ValueError, match="--centers"):
        cli_calibrate.settings_from(_args(tmp_path, "--centers"))
    with pytest.raises(ValueError, match="held_out must be a non-negative integer, got -1"):
        cli_calibrate.settings_from(_args(tmp_path, "--held-out", "-1"))


def test_a_run_trains_writes_the_gate_and_its_summary(tmp_path, monkeypatch):
    model = tiny_llama(layers=2)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 90, (100,), generator=generator).tolist() for _ in range(4)]
    monkeypatch.setattr(gates_module, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(gates_module, "self_traces", lambda *a, **k: sequences)
    settings = GatesSettings(
        model="tiny",
        traces=3,
        held_out=1,
        block_size=16,
        gate_dim=8,
        steps=12,
        lr=1e-2,
        progress=False,
        out=tmp_path / "gates",
    )
    assert run_gates(settings) == 0
    summary = json.loads((tmp_path / "gates" / "gates.json").read_text())
    assert len(summary["losses"]) == 12 and summary["losses"][-1] < summary["losses"][0]
    assert set(summary["recall"]["top1"]) == {"trained", "untrained", "quest"}
    gate_file = load_gate(tmp_path / "gates" / "gates.pt")
    assert gate_file.gate.shape.block_size == 16 and gate_file.training["steps"] == 12


def _settings(tmp_path, **overrides):
    options = dict(model="tiny", traces=3, held_out=1, block_size=16, gate_dim=8, steps=4, progress=False)
    return GatesSettings(**{**options, "out": tmp_path / "gates", **overrides})


def _fake_run(monkeypatch, sequences):
    """The tiny model instead of a loaded one, and ``sequences`` instead of its own answers."""
    model = tiny_llama(layers=2)
    monkeypatch.setattr(gates_module, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(gates_module, "self_traces", lambda *a, **k: sequences)


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the refusal")


@pytest.mark.parametrize("name", ["gates.json", "gates.pt"])
def test_a_users_file_in_the_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch, name):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / name).write_text("mine\n")
    (tmp_path / "gates" / "notes.txt").write_text("my notes\n")
    monkeypatch.setattr(gates_module, "load_model", _no_model)
    with pytest.raises(ValueError, match=rf"gates/{name} exists and was not written by `reasonkv calibrate`"):
        run_gates(_settings(tmp_path))
    assert sorted(p.name for p in (tmp_path / "gates").iterdir()) == sorted([name, "notes.txt"])
    assert (tmp_path / "gates" / name).read_text() == "mine\n"


def test_a_run_writes_over_its_own_output_and_adopts_one_from_before_markers(tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    _fake_run(monkeypatch, [torch.randint(3, 90, (80,), generator=generator).tolist() for _ in range(4)])
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "notes.txt").write_text("my notes\n")
    assert run_gates(_settings(tmp_path)) == 0
    assert run_gates(_settings(tmp_path, steps=5)) == 0  # again, into its own output
    assert json.loads((tmp_path / "gates" / "gates.json").read_text())["settings"]["steps"] == 5
    marker = json.loads((tmp_path / "gates" / ".reasonkv.json").read_text())
    assert marker["command"] == "calibrate" and {"gates.pt", "gates.json"} <= set(marker["files"])
    (tmp_path / "gates" / ".reasonkv.json").unlink()  # as a folder written before markers existed
    assert run_gates(_settings(tmp_path, steps=6)) == 0
    assert load_gate(tmp_path / "gates" / "gates.pt").training["steps"] == 6
    assert (tmp_path / "gates" / "notes.txt").read_text() == "my notes\n"


def test_settings_that_cannot_make_a_trace_long_enough_are_refused_before_generating(tmp_path, monkeypatch):
    monkeypatch.setattr(gates_module, "prompt_ids", lambda tokenizer, problem: [5] * 40)
    monkeypatch.setattr(gates_module, "generate", _no_model)
    settings = _settings(tmp_path, block_size=64, max_new_tokens=16)
    assert (settings.shortest(), settings.shortest(held_out=True)) == (129, 257)
    with pytest.raises(ValueError) as caught:
        gates_module.self_traces(None, None, settings)
    message = str(caught.value)
    assert "--max-new-tokens 16 is too few: a training trace needs at least 129 tokens" in message
    assert "a held-out one 257 (more than 3 blocks" in message
    assert "problem gsm8k-test-0003's prompt of 40 tokens" in message
    assert "use --max-new-tokens 217 or more" in message  # 257 - 40, for the held-out problem
    settings = _settings(tmp_path, block_size=64, max_new_tokens=16, held_out=0)
    with pytest.raises(ValueError, match="use --max-new-tokens 89 or more"):  # 129 - 40
        gates_module.self_traces(None, None, settings)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([20, 30, 32, 80], "none of the 3 training traces reached 33 tokens"),  # two whole blocks of 16, and one
        ([80, 80, 80, 64], "none of the 1 held-out traces reached 65 tokens"),  # four, for the top-3 recall
    ],
)
def test_traces_too_short_to_learn_from_write_nothing(tmp_path, monkeypatch, lengths, message):
    _fake_run(monkeypatch, [[7] * n for n in lengths])
    with pytest.raises(ValueError, match=message):
        run_gates(_settings(tmp_path))
    assert not (tmp_path / "gates" / "gates.pt").exists() and not (tmp_path / "gates" / "gates.json").exists()


def test_traces_that_ended_early_are_left_out_and_said(tmp_path, monkeypatch, capsys):
    generator = torch.Generator().manual_seed(1)
    _fake_run(monkeypatch, [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (80, 20, 80, 80)])
    assert run_gates(_settings(tmp_path)) == 0
    assert "1 of 3 training traces ended before 33 tokens" in capsys.readouterr().err
    summary = json.loads((tmp_path / "gates" / "gates.json").read_text())
    assert summary["traces"] == 2 and summary["losses"][0] > 0
    assert all(v == v for k in summary["recall"].values() for v in k.values())  # no nan
