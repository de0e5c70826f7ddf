"""``reasonkv calibrate --gates``: the command line's settings, and a whole run on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from conftest import tiny_llama
from reasonkv.calibrate import gates as gates_module
from reasonkv.calibrate import shared as calibrate_shared
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
    monkeypatch.setattr(calibrate_shared, "load_model", lambda *a, **k: (model, None))
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
    monkeypatch.setattr(calibrate_shared, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(gates_module, "self_traces", lambda *a, **k: sequences)


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the refusal")


@pytest.mark.parametrize("name", ["gates.json", "gates.pt"])
def test_a_users_file_in_the_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch, name):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / name).write_text("mine\n")
    (tmp_path / "gates" / "notes.txt").write_text("my notes\n")
    monkeypatch.setattr(calibrate_shared, "load_model", _no_model)
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


def test_a_pack_too_short_for_the_gate_to_learn_from_is_refused_with_the_settings(tmp_path):
    settings = _settings(tmp_path, block_size=64)
    assert (settings.shortest(), settings.shortest(held_out=True)) == (129, 257)
    with pytest.raises(ValueError) as caught:
        _settings(tmp_path, block_size=64, pack=200)
    message = str(caught.value)
    assert "--gate-pack 200 is too short: a training sequence needs at least 129 tokens" in message
    assert "a held-out one 257 (more than 3 blocks" in message and "use --gate-pack 257 or more" in message
    with pytest.raises(ValueError, match="use --gate-pack 129 or more"):
        _settings(tmp_path, block_size=64, pack=100, held_out=0)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([10, 12, 14, 80], "no trace to train on"),  # no training sequence holds a block to choose
        ([80, 80, 80, 40], "the held-out recall"),  # under four blocks of 16: the top 3 are every block
    ],
)
def test_sequences_too_short_to_learn_from_write_nothing(tmp_path, monkeypatch, lengths, message):
    _fake_run(monkeypatch, [[7] * n for n in lengths])
    with pytest.raises(ValueError, match=message):
        run_gates(_settings(tmp_path))
    assert not (tmp_path / "gates" / "gates.pt").exists() and not (tmp_path / "gates" / "gates.json").exists()


def test_answers_are_packed_whole_into_sequences_of_at_least_the_length():
    answers = [[1] * 5, [2] * 7, [3] * 3, [4] * 9, [5] * 2]
    packed = gates_module.pack_sequences(answers, 10)
    assert packed == [[1] * 5 + [2] * 7, [3] * 3 + [4] * 9]  # the 2 left over fill no third sequence


def test_the_loss_is_taken_in_the_later_half_of_a_long_sequence():
    rows = gates_module.query_rows(2048, 64, 128, later_half=True)
    assert int(rows.min()) == 1024 and int(rows.max()) == 2047 and len(rows) == 128
    everywhere = gates_module.query_rows(2048, 64, 128, later_half=False)
    assert int(everywhere.min()) == 64
    short = gates_module.query_rows(100, 64, 128, later_half=True)  # the middle is inside the first block
    assert int(short.min()) == 64 and len(short) == 36


def test_the_defaults_are_the_authors_training_settings(tmp_path):
    settings = cli_calibrate.settings_from(_args(tmp_path))
    assert (settings.temperature, settings.pack, settings.gate_dim) == (0.6, 2048, 128)
    assert settings.qk_norm and settings.init == "normal" and settings.later_half
    other = cli_calibrate.settings_from(
        _args(tmp_path, "--no-gate-norm", "--gate-init", "xavier", "--gate-loss-everywhere", "--gate-temperature", "0")
    )
    assert not other.qk_norm and other.init == "xavier" and not other.later_half and other.temperature == 0
    assert "--no-gate-norm" in other.command() and "--gate-init xavier" in other.command()
    with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or above, got -1.0"):
        cli_calibrate.settings_from(_args(tmp_path, "--gate-temperature", "-1"))
