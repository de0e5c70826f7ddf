"""``reasonkv calibrate --budgets``: attention mass per (layer, kv-head) beyond a streaming head's share, its
file, and the cache that reads it."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.cache import CacheSpec
from reasonkv.calibrate import budgets as calibrate_budgets
from reasonkv.calibrate.budgets import BudgetsSettings, head_mass
from reasonkv.cli import calibrate as cli_calibrate


def _reference(model, sequences, sinks: int, window: int) -> torch.Tensor:
    """The same mass from the eager kernel's own attention weights."""
    config = model.config
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    sums = torch.zeros(config.num_hidden_layers, kv_heads, dtype=torch.float64)
    queries = 0
    original = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        for ids in sequences:
            out = model(input_ids=torch.tensor([ids]), use_cache=False, output_attentions=True)
            length = len(ids)
            t = torch.arange(length).view(-1, 1)
            slot = torch.arange(length).view(1, -1)
            far = ((slot >= sinks) & (slot <= t - window)).double()
            rows = slice(sinks + window, length)
            for layer, weights in enumerate(out.attentions):  # [1, heads, length, length]
                mass = (weights[0].double() * far).sum(-1)[:, rows]  # [heads, queries]
                sums[layer] += mass.view(kv_heads, heads // kv_heads, -1).mean(1).sum(-1)
            queries += max(0, length - sinks - window)
    finally:
        config._attn_implementation = original
    return sums / queries


def test_head_mass_is_the_kernels_attention_beyond_sinks_and_window(monkeypatch):
    monkeypatch.setattr(calibrate_budgets, "CHUNK", 7)  # several chunks per sequence
    model = tiny_llama(layers=3, kv_heads=2, heads=4)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (40, 25, 9)]
    got, queries = head_mass(model, sequences, sinks=2, window=5)
    want = _reference(model, sequences, 2, 5)
    assert queries == (40 - 7) + (25 - 7) + (9 - 7)
    assert got.shape == (3, 2) and bool((got > 0).all()) and bool((got < 1).all())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_written_file_drives_a_calibrated_cache(tmp_path, monkeypatch):
    model = tiny_llama(layers=3, kv_heads=2, heads=4)
    monkeypatch.setattr(calibrate_budgets, "load_model", lambda *a, **k: (model, None))
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
