"""Paired fidelity (``python -m reasonkv.cli.paired``): differences to a reference policy, problem by problem."""

from __future__ import annotations

import json
import math

import pytest

from reasonkv.cli import paired as paired_command
from reasonkv.eval.paired import markdown, paired_fidelity


def _fidelity(policy, problem, top1, kl=0.1, budget=128, label=None, tier=None, dataset="gsm8k"):
    return {
        "kind": "fidelity",
        "model": "m",
        "dataset": dataset,
        "problem_id": f"p{problem:02d}",
        "sample": 0,
        "policy": policy,
        "policy_label": label or policy,
        "policy_config": {"policy": policy},  # part of a unit's identity when a file is read
        "budget": budget,
        "buffer": 16,
        "tier": tier,
        "top1_agreement": top1,
        "kl_mean": kl,
    }


def _records():
    records = []
    for p in range(12):
        records.append(_fidelity("h2o", p, 0.80 + 0.01 * p, kl=0.2))
        records.append(_fidelity("snapkv", p, 0.80 + 0.01 * p - 0.02, kl=0.3))  # 0.02 below on every problem
        records.append(_fidelity("streaming", p, 0.90 if p % 2 else 0.70))  # above on half, below on half
    records += [_fidelity("keydiff", p, 0.5) for p in range(4)]  # 4 shared problems: no interval
    records.append(_fidelity("h2o", 0, 0.99, tier={"bits": 4, "quantized": 60}))  # a tier: its own label
    records.append(_fidelity("h2o", 0, float("nan")))  # NaN: left out, the earlier record stays
    records.append(_fidelity("h2o", 0, 0.5, budget=64))  # another cell, K = 64: listed first
    records.append(_fidelity("snapkv", 0, 0.4, budget=64))
    records.append(_fidelity("snapkv", 0, 0.4, dataset="math500"))  # a cell without the reference: skipped
    return records


def test_each_policy_is_paired_with_the_reference_on_the_problems_both_have():
    rows = paired_fidelity(_records(), "h2o")
    assert [(r.budget, r.policy) for r in rows] == [
        (64, "h2o"),
        (64, "snapkv"),
        (128, "h2o + int4 x 60"),
        (128, "h2o"),
        (128, "snapkv"),
        (128, "streaming"),
        (128, "keydiff"),
    ]
    by_policy = {r.policy: r for r in rows if r.budget == 128}
    snapkv, streaming, keydiff = by_policy["snapkv"], by_policy["streaming"], by_policy["keydiff"]
    assert snapkv.problems == 12 and snapkv.delta == pytest.approx(-0.02)
    assert snapkv.low == pytest.approx(-0.02) and snapkv.high == pytest.approx(-0.02)  # the same difference each time
    assert snapkv.top1 == pytest.approx(0.835) and snapkv.kl == pytest.approx(0.3)
    differences = [(0.90 if p % 2 else 0.70) - (0.80 + 0.01 * p) for p in range(12)]
    assert streaming.delta == pytest.approx(sum(differences) / 12)
    assert min(differences) < streaming.low < streaming.delta < streaming.high < max(differences)
    assert keydiff.problems == 4 and keydiff.delta == pytest.approx(0.5 - 0.815)
    assert math.isnan(keydiff.low) and math.isnan(by_policy["h2o"].low)
    assert by_policy["h2o + int4 x 60"].problems == 1 and by_policy["h2o + int4 x 60"].top1 == pytest.approx(0.99)
    text = markdown(rows, "h2o")
    assert text.index("### m, gsm8k, K = 64, B = 16: against h2o") < text.index("### m, gsm8k, K = 128, B = 16")
    assert "| h2o | 12 | 0.855 | 0.2000 | +0.000 | reference |" in text
    assert "| snapkv | 12 | 0.835 | 0.3000 | -0.020 | [-0.020, -0.020] |" in text
    assert "| keydiff | 4 | 0.500 | 0.1000 | -0.315 | — (fewer than 10 problems) |" in text
    assert "math500" not in text


def test_an_unknown_reference_names_the_policies_there_are():
    with pytest.raises(ValueError, match=r"'tova'; the policies there are: \['h2o', 'h2o \+ int4 x 60', 'keydiff'"):
        paired_fidelity(_records(), "tova")


def test_the_command_reads_results_files_and_writes_the_tables(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _records()[:36]), encoding="utf-8")
    out = tmp_path / "paired.md"
    assert paired_command.main([str(results), "--against", "snapkv", "--out", str(out)]) == 0
    assert "| snapkv | 12 | 0.835 | 0.3000 | +0.000 | reference |" in out.read_text()
    assert "| h2o | 12 | 0.855 | 0.2000 | +0.020 | [+0.020, +0.020] |" in out.read_text()
    with pytest.raises(SystemExit):
        paired_command.main([str(results), "--against", "tova"])
    assert "no fidelity records of the reference policy 'tova'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired_command.main([str(tmp_path / "missing.jsonl")])
    assert "no such results file" in capsys.readouterr().err
    shard = tmp_path / "run.shard-0-of-2.jsonl"  # a run in progress: only its shard files exist yet
    shard.write_text(results.read_text(encoding="utf-8"), encoding="utf-8")
    assert paired_command.main([str(tmp_path / "run.jsonl")]) == 0
    assert "| snapkv | 12 | 0.835 | 0.3000 | -0.020 | [-0.020, -0.020] |" in capsys.readouterr().out
