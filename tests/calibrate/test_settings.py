"""``CalibrateSettings``: what the command line builds, what a Python caller builds, checked once."""

from __future__ import annotations

import shlex

import pytest

from reasonkv.calibrate.labels import LabelSettings
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.calibrate.signals import SignalSettings
from reasonkv.cli import main
from reasonkv.cli.calibrate import settings_from
from reasonkv.cli.main import build_parser


def _settings(argv: list[str]) -> CalibrateSettings:
    return settings_from(build_parser(["calibrate"]).parse_args(["calibrate", *argv]))


def test_the_flags_defaults_are_the_settings_defaults():
    assert _settings(["--out", "o"]) == CalibrateSettings(out="o")


@pytest.mark.parametrize(
    "argv",
    [
        ["--out", "o"],
        ["--model", "m", "--dtype", "bf16", "--dataset", "d.jsonl", "--traces", "7", "--source", "generated"],
        ["--max-new-tokens", "99", "--source", "generated", "--max-trace-tokens", "50", "--chunk-size", "4"],
        ["--horizon", "16", "--batch-size", "2", "--window", "64", "--target", "answer", "--signal", "g"],
        ["--control", "none", "--bootstrap", "10", "--device", "cpu", "--out", "a folder"],
    ],
)
def test_the_command_it_records_rebuilds_the_settings(argv):
    settings = _settings([*argv, "--out", "o"] if "--out" not in argv else argv)
    command = shlex.split(settings.command())
    assert command[:2] == ["reasonkv", "calibrate"] and _settings(command[2:]) == settings


def test_record_settings_depend_on_what_changes_the_records():
    reference = CalibrateSettings(out="o", max_new_tokens=64)
    assert reference.record_settings()["max_new_tokens"] is None  # no generation: not part of the records
    generated = CalibrateSettings(out="o", source="generated", max_new_tokens=64)
    assert generated.record_settings()["max_new_tokens"] == 64
    assert CalibrateSettings(out="o", target="answer").targets == ["answer"]
    assert CalibrateSettings(out="o").targets == ["later", "answer"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"traces": 0}, "traces must be a positive integer, got 0"),
        ({"max_trace_tokens": -1}, "max_trace_tokens must be a positive integer"),
        ({"source": "mine"}, "source must be one of reference, generated, got 'mine'"),
        ({"target": "later-sum"}, "target must be one of later, later_sum, answer"),
        ({"signal": "h"}, "signal must be one of z, g"),
        ({"control": "length"}, "control must be one of position, none"),
        ({"top_fraction": 1.0}, r"top_fraction must be in \(0, 1\), got 1.0"),
        ({"min_width": 5, "max_width": 4}, "min_width 5 is larger than max_width 4"),
        ({"labels": {"chunk_size": 8}}, "labels and signals must be a LabelSettings and a SignalSettings"),
        ({"seed": "0"}, "seed must be an integer"),
    ],
)
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        CalibrateSettings(out="o", **changes)


def test_the_label_and_signal_settings_come_from_their_flags():
    settings = _settings(
        ["--chunk-size", "4", "--horizon", "all", "--batch-size", "3", "--query-window", "8", "--out", "o"]
    )
    assert settings.labels == LabelSettings(chunk_size=4, horizon=None, batch_size=3)
    assert settings.signals == SignalSettings(query_window=8)


def test_the_command_line_refuses_crossed_widths(capsys, tmp_path):
    argv = ["calibrate", "--min-width", "5", "--max-width", "4", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "min_width 5 is larger than max_width 4" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before the folder is touched
