"""``reasonkv calibrate --centers``: the query centers of a model, its file, and the command's settings."""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from reasonkv.calibrate.centers import CentersSettings, compute_centers
from reasonkv.cli import calibrate as cli_calibrate
from reasonkv.hf import model_info
from reasonkv.policies.query_centers import QueryCenters


def test_centers_are_the_mean_pre_rope_query_pairs_and_round_trip(tmp_path):
    model = tiny_llama(layers=2)
    sequences = [[5, 6, 7, 8, 9], [10, 11, 12]]
    centers = compute_centers(model, sequences, name="tiny", source="two sequences")
    assert centers.tokens == 8 and centers.mean.shape == (2, 4, 8) and centers.layers == (0, 1)
    # the mean of the two sequences' own centers, weighted by their lengths
    parts = [compute_centers(model, [ids]) for ids in sequences]
    torch.testing.assert_close(centers.mean, (5 * parts[0].mean + 3 * parts[1].mean) / 8)
    assert (centers.modulus >= centers.mean.abs() - 1e-6).all()  # E|q| >= |E q|
    path = tmp_path / "centers.pt"
    centers.save(path)
    loaded = QueryCenters.load(path)
    assert torch.equal(loaded.mean, centers.mean) and loaded.fingerprint == model_info(model).fingerprint
    assert (loaded.model, loaded.source, loaded.tokens) == ("tiny", "two sequences", 8)


def test_a_hybrid_models_centers_cover_its_full_attention_layers():
    model = tiny_gemma3()
    centers = compute_centers(model, [[5, 6, 7, 8, 9, 10, 11, 12]])
    assert centers.layers == model_info(model).full_layers == (1, 3)


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    cli_calibrate.add_arguments(parser)
    return parser.parse_args(["--centers", "--out", str(tmp_path / "c.pt"), *extra])


def test_settings_from_the_command_line(tmp_path):
    settings = cli_calibrate.settings_from(_args(tmp_path, "--dataset", "aime24", "--traces", "3"))
    assert isinstance(settings, CentersSettings) and settings.traces == 3
    assert settings.command().startswith("reasonkv calibrate --centers --model smollm2-135m --dataset aime24")


def test_bad_settings_are_clear_errors_and_touch_no_file(tmp_path):
    notes = tmp_path / "c.pt"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="exists and is not a query centers file; it is left untouched"):
        cli_calibrate.settings_from(_args(tmp_path))
    assert notes.read_text() == "my notes"
    with pytest.raises(ValueError, match="is not a file"):
        CentersSettings(text=tmp_path / "missing.txt", out=tmp_path / "new.pt")
    with pytest.raises(ValueError, match="is a folder"):
        CentersSettings(out=tmp_path)
    parser = argparse.ArgumentParser()
    cli_calibrate.add_arguments(parser)
    args = parser.parse_args(["--text", str(notes), "--out", str(tmp_path / "anatomy")])
    with pytest.raises(ValueError, match="--text is read by --centers and --budgets only"):
        cli_calibrate.settings_from(args)
    # --gates reads its own traces: a --text beside it is refused, not ignored.
    args = parser.parse_args(["--gates", "--text", str(notes), "--out", str(tmp_path / "gates")])
    with pytest.raises(ValueError, match="--text is read by --centers and --budgets only"):
        cli_calibrate.settings_from(args)
