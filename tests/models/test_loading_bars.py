"""transformers' "Loading weights" bar: on a terminal only, never under --no-progress or --json."""

from __future__ import annotations

import argparse
import sys

import pytest
from transformers.utils import logging as transformers_logging

import reasonkv.models.load as load
from reasonkv.cli.args import load_model_from


@pytest.fixture
def bars_seen(monkeypatch) -> list[bool]:
    """Whether transformers' bars were on while a model loaded (the load itself replaced by a probe)."""
    seen: list[bool] = []

    def probe(*args):
        seen.append(transformers_logging.is_progress_bar_enabled())
        return "model", "tokenizer"

    monkeypatch.setattr(load, "_load_named", probe)
    transformers_logging.enable_progress_bar()
    return seen


@pytest.mark.parametrize(
    ("terminal", "progress", "shown"), [(False, None, False), (True, None, True), (True, False, False)]
)
def test_the_bar_shows_on_a_terminal_unless_turned_off(bars_seen, monkeypatch, terminal, progress, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert load.load_model("some-model", progress=progress) == ("model", "tokenizer")
    assert bars_seen == [shown]
    assert transformers_logging.is_progress_bar_enabled()  # as it was, after the load


@pytest.mark.parametrize("quiet", [{"json": True}, {"no_progress": True}])
def test_json_and_no_progress_load_without_bars_even_on_a_terminal(bars_seen, monkeypatch, quiet):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    args = argparse.Namespace(model="some-model", dtype="fp32", device="cpu", attn="sdpa", **quiet)
    load_model_from(args)
    assert bars_seen == [False]
