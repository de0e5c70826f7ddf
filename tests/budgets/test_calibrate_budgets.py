"""``reasonkv calibrate --budgets``: attention mass per (layer, kv-head) beyond a streaming head's share, its
file, and the cache that reads it."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from eager_mass import eager_head_mass
from reasonkv.cache import CacheSpec
from reasonkv.calibrate import budgets as calibrate_budgets
from reasonkv.calibrate import shared as calibrate_shared
from reasonkv.calibrate.budgets import BudgetsSettings, head_mass
from reasonkv.cli import calibrate as cli_calibrate


def test_head_mass_is_the_kernels_attention_beyond_sinks_and_window(monkeypatch):
    monkeypatch.setattr(calibrate_budgets, "CHUNK", 7)  # several chunks per sequence
    model = tiny_llama(layers=3, kv_heads=2, heads=4)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (40, 25, 9)]
    got, queries = head_mass(model, sequences, sinks=2, window=5)
    want = eager_head_mass(model, sequences, 2, 5)
    assert queries == (40 - 7) + (25 - 7) + (9 - 7)
    assert got.shape == (3, 2) and bool((got > 0).all()) and bool((got < 1).all())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_written_file_drives_a_calibrated_cache(tmp_path, monkeypatch):
    model = tiny_llama(layers=3, kv_heads=2, heads=4)
    monkeypatch.setattr(calibrate_shared, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(calibrate_budgets, "read_sequences", lambda settings, tokenizer: [list(range(3, 60))])
    out = tmp_path / "budgets.json"
    settings = BudgetsSettings(model="tiny", sinks=2, window=8, out=out)
    assert calibrate_budgets.run_budgets(settings) == 0
    record = json.loads(out.read_text())
    assert (record["layers"], record["kv_heads"], record["queries"]) == (3, 2, 57 - 10)
    assert "--budget-window 8" in record["command"]
    spec = CacheSpec.build("h2o", 12, 4, allocation="calibrated", budgets_file=str(out))
    table = spec.budget_table(3, 2)
    assert int(table.sum()) == 12 * 3 * 2 and bool((table >= 4).all())
    [result] = reasonkv.generate(model, None, [list(range(3, 50))], spec=spec, max_new_tokens=20, chat=False)
    assert result.stats["evictions"] > 0
    again = BudgetsSettings(model="tiny", out=out)  # its own file may be replaced
    assert again.out == out


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    cli_calibrate.add_arguments(parser)
    return parser.parse_args(["--budgets", "--out", str(tmp_path / "b.json"), *extra])


def test_settings_from_the_command_line(tmp_path):
    settings = cli_calibrate.settings_from(_args(tmp_path, "--traces", "3", "--budget-window", "32"))
    assert isinstance(settings, BudgetsSettings) and (settings.traces, settings.window, settings.sinks) == (3, 32, 4)
    assert settings.command().startswith("reasonkv calibrate --budgets --model smollm2-135m --dataset gsm8k")
    with pytest.raises(ValueError, match="does not combine with --analyse-only, --centers or --gates"):
        cli_calibrate.settings_from(_args(tmp_path, "--centers"))
    notes = tmp_path / "b.json"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="exists and is not a budget file; it is left untouched"):
        cli_calibrate.settings_from(_args(tmp_path))
    assert notes.read_text() == "my notes"
