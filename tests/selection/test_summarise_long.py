"""docs/results/selection/summarise_long.py on a small run under way: two cells of two problems each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docs/results/selection/summarise_long.py"


def _script():
    spec = importlib.util.spec_from_file_location("summarise_long", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(problem: str, top1: float, kl: float, held: float, read: float) -> dict:
    return {
        "problem": problem,
        "tokens": 10,
        "top1_agreement": top1,
        "kl_mean": kl,
        "kv_bytes_held_per_step": held,
        "kv_bytes_read_per_step": read,
    }


def test_the_cells_are_paired_by_problem_against_vase_and_the_missing_cells_named(tmp_path):
    traces = [
        {"kind": "trace", "problem": "p1", "prompt": [1] * 6, "answer": [2] * 4, "seconds": 5.0},
        {"kind": "trace", "problem": "p2", "prompt": [1] * 8, "answer": [2] * 2, "seconds": 9.0},
    ]
    vase = [_row("p1", 0.9, 0.1, 2e6, 2e6), _row("p2", 0.8, 0.3, 2e6, 2e6)]
    quest = [_row("p2", 0.5, 0.5, 8e6, 1e6), _row("p1", 0.8, 0.2, 8e6, 1e6)]  # rows out of order: paired by problem
    cells = [
        {"kind": "cell", "policy": "vase-attnv", "budget": 128, "seconds": 30.0, "rows": vase},
        {"kind": "cell", "policy": "quest", "budget": 128, "seconds": 12.0, "rows": quest},
    ]
    path = tmp_path / "long-traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in traces + cells), encoding="utf-8")

    text = _script().main(path)

    assert (tmp_path / "long-traces.md").read_text(encoding="utf-8") == text
    lines = text.splitlines()
    vase_line = next(line for line in lines if line.startswith("| vase-attnv |"))
    quest_line = next(line for line in lines if line.startswith("| quest |"))
    assert lines.index(vase_line) < lines.index(quest_line)  # the higher top-1 first
    # quest: top-1 (0.8 + 0.5) / 2, Δ top-1 ((0.8 - 0.9) + (0.5 - 0.8)) / 2, Δ KL ((0.2 - 0.1) + (0.5 - 0.3)) / 2;
    # two problems are too few for an interval
    assert quest_line == (
        "| quest | selection (holds all) | 2 | 0.650 | 0.350 | 8.00 | 1.00 | 12 | -0.200 (2 problems) "
        "| +0.150 (2 problems) |"
    )
    assert vase_line.endswith("| 30 | reference | reference |")
    assert "| answer | 2 | 2.5 | 3 | 3.5 | 4 |" in lines
    assert "Cells: 2, 42 s in all (K = 128: 42 s); sampling the traces: 9 s." in lines
    missing = next(line for line in lines if line.startswith("Missing cells:"))
    assert "seer K=128" in missing and "quest K=512" in missing and "quest K=128" not in missing
    assert "## K = 512" in lines and "No cell yet." in lines
    assert (tmp_path / "long-traces.png").stat().st_size > 0


def test_ten_problems_get_the_bootstrap_interval_of_their_differences():
    def cell(top1):
        return {"seconds": 1.0, "rows": [_row(f"p{i}", top1 + i / 100, 0.1, 1e6, 1e6) for i in range(10)]}

    row = _script().summary(cell(0.7), cell(0.8))
    assert row["paired"] == 10
    assert row["delta_top1"] == pytest.approx(-0.1)
    assert row["interval_top1"] == pytest.approx((-0.1, -0.1))  # every difference the same
    assert row["interval_kl"] == (0.0, 0.0)
