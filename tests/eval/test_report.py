"""``reasonkv report`` on a hand-written results file: numbers, table, plots."""

from __future__ import annotations

import json
import math

import pytest

from reasonkv.eval.report import load_results, markdown, summarize, wilson_interval, write_report

SETTINGS = {"model": "m", "dtype": "fp32", "max_new_tokens": 100, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def _gen(problem, policy, budget, correct, tokens, tps, collapsed, dataset="gsm8k", **extra):
    buffer = None if budget is None else 64
    return {
        "kind": "generation", **SETTINGS, "dataset": dataset, "problem_id": problem, "policy": policy,
        "policy_label": policy, "policy_config": {"policy": policy}, "budget": budget, "buffer": buffer,
        "sample": 0, "base_seed": 0, "prompt_format": "chat", "correct": correct, "output_tokens": tokens,
        "tokens_per_second": tps, "collapsed": collapsed, **extra,
    }  # fmt: skip


def _fid(problem, budget, top1, kl, delta, delta_mean):
    return {
        "kind": "fidelity", "model": "m", "dtype": "fp32", "dataset": "gsm8k", "problem_id": problem,
        "policy": "streaming", "policy_label": "streaming", "policy_config": {"policy": "streaming"},
        "budget": budget, "buffer": 64, "base_seed": 0, "fidelity_tokens": 100, "prompt_format": "chat",
        "top1_agreement": top1, "kl_mean": kl, "answer_logprob_delta": delta, "answer_logprob_delta_mean": delta_mean,
    }  # fmt: skip


RECORDS = [
    _gen("a", "full", None, True, 10, 10.0, False),
    _gen("b", "full", None, True, 20, 20.0, False),
    _gen("c", "full", None, False, 30, 30.0, True),
    _gen("d", "full", None, True, 40, 40.0, False),
    _gen("a", "streaming", 128, True, 50, 1.0, True),
    _gen("b", "streaming", 128, False, 60, 2.0, True),
    _gen("c", "streaming", 128, False, 70, 3.0, False),
    _gen("d", "streaming", 128, False, 80, 4.0, False),
    _gen("a", "streaming", 256, True, 90, 5.0, False),
    _gen("b", "streaming", 256, True, 100, float("nan"), False),  # nan tokens/s is left out of the mean
    _gen("a", "full", None, True, 10, 10.0, False),  # a duplicate of the first record: counted once
    _gen("a", "full", None, False, 5, 1.0, False, dataset="math500"),
    _fid("a", 128, 0.8, 0.1, -1.0, -0.5),
    _fid("b", 128, 0.6, 0.3, None, None),  # no reference solution: no answer delta
    _fid("a", 256, 1.0, 0.0, 0.0, 0.0),
]


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [json.dumps(r) for r in RECORDS]
    path.write_text("\n".join(lines) + "\n" + '{"kind": "generation", "model": "m", "corr', encoding="utf-8")
    return path


def _wilson_by_quadratic(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    # The interval is the set of p with (k/n - p)^2 <= z^2 p (1 - p) / n: the roots of a quadratic.
    phat = k / n
    a = 1 + z * z / n
    b = -(2 * phat + z * z / n)
    c = phat * phat
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


def test_wilson_interval_matches_the_quadratic_and_known_values():
    for k, n in [(0, 10), (3, 4), (1, 4), (7, 7), (50, 100), (1, 1)]:
        lo, hi = wilson_interval(k, n)
        want_lo, want_hi = _wilson_by_quadratic(k, n)
        assert lo == pytest.approx(want_lo, abs=1e-9) and hi == pytest.approx(want_hi, abs=1e-9)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_rows_hold_the_right_numbers(results):
    rows = summarize(load_results(results))
    by = {(r.section.dataset, r.policy, r.budget): r for r in rows}
    assert list(by) == [
        ("gsm8k", "full", None),
        ("gsm8k", "streaming", 128),
        ("gsm8k", "streaming", 256),
        ("math500", "full", None),
    ]
    full = by["gsm8k", "full", None]
    assert (full.n, full.correct, full.accuracy) == (4, 3, 0.75)
    assert (full.ci_low, full.ci_high) == pytest.approx(_wilson_by_quadratic(3, 4))
    assert full.mean_output_tokens == 25.0 and full.tokens_per_second == 25.0 and full.collapse_rate == 0.25
    assert full.fidelity_n == 0 and math.isnan(full.top1_agreement)

    s128 = by["gsm8k", "streaming", 128]
    assert (s128.n, s128.correct, s128.accuracy) == (4, 1, 0.25)
    assert s128.mean_output_tokens == 65.0 and s128.tokens_per_second == 2.5 and s128.collapse_rate == 0.5
    assert s128.fidelity_n == 2 and s128.top1_agreement == pytest.approx(0.7) and s128.kl_mean == pytest.approx(0.2)
    assert s128.answer_n == 1 and s128.answer_logprob_delta == -1.0 and s128.answer_logprob_delta_mean == -0.5

    s256 = by["gsm8k", "streaming", 256]
    assert (s256.n, s256.accuracy, s256.tokens_per_second) == (2, 1.0, 5.0)
    assert (s256.top1_agreement, s256.kl_mean, s256.answer_logprob_delta) == (1.0, 0.0, 0.0)

    math_row = by["math500", "full", None]
    assert (math_row.n, math_row.accuracy, math_row.fidelity_n) == (1, 0.0, 0)


def test_markdown_table(results):
    text = markdown(summarize(load_results(results)), source="results.jsonl")
    lo, hi = _wilson_by_quadratic(1, 4)
    assert "## gsm8k · m (max 100 new tokens; temperature 0), buffer B=64" in text
    assert "| full | — | 4 | 0.750 [0.301, 0.954] | 25.0 | 25.0 | 0.250 | — | — | — | — |" in text
    assert (
        f"| streaming | 128 | 4 | 0.250 [{lo:.3f}, {hi:.3f}] | 65.0 | 2.5 | 0.500 | 0.700 | 0.2 | -1.000 | -0.500 |"
        in text
    )
    assert "| streaming | 256 | 2 | 1.000 [0.342, 1.000] | 95.0 | 5.0 | 0.000 | 1.000 | 0 | +0.000 | +0.000 |" in text
    assert "## math500 · m" in text
    assert text.count("| full |") == 2


def test_write_report_writes_table_summary_and_plots(results, tmp_path):
    out = tmp_path / "report"
    written = write_report(results, out)
    assert written["markdown"].read_text(encoding="utf-8").startswith("# Evaluation report")
    summary = json.loads(written["summary"].read_text(encoding="utf-8"))
    assert len(summary) == 4 and summary[1]["accuracy"] == 0.25 and summary[0]["top1_agreement"] is None
    names = sorted(p.name for p in written["plots"])
    assert names == sorted(
        [
            "gsm8k-m-accuracy.png",
            "gsm8k-m-collapse.png",
            "gsm8k-m-throughput.png",
            "gsm8k-m-fidelity.png",
            "math500-m-accuracy.png",
            "math500-m-collapse.png",
            "math500-m-throughput.png",
        ]
    )
    for path in written["plots"]:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_report_command(results, tmp_path, capsys):
    from reasonkv.cli import main

    assert main(["report", str(results), "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert "| streaming | 128 | 4 |" in captured.out
    assert (tmp_path / "r" / "gsm8k-m-fidelity.png").is_file()
    assert main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r")]) == 2
    assert "no such results file" in capsys.readouterr().err


def test_a_file_without_records_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no generation or fidelity records"):
        write_report(empty, tmp_path / "out")


def test_report_imports_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import reasonkv.eval.report, reasonkv.eval.records, reasonkv.eval.grading; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
