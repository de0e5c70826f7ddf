"""``reasonkv report`` on a hand-written results file: numbers, table, plots."""

from __future__ import annotations

import json
import math

import pytest

from reasonkv.eval.collapse import collapse_flags
from reasonkv.eval.manifest import manifest_id
from reasonkv.eval.report import (
    load_results,
    markdown,
    pass_at_k,
    summarize,
    wilson_interval,
    write_report,
)

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


def test_an_early_stop_without_an_answer_is_counted_apart_from_collapse():
    # full runs out of tokens on one problem of two (a collapse); epikv stops after a few tokens without an
    # answer on both: its collapse rate is 0, and only the early-stop rate shows that it answered nothing
    def flags(text, *, max_new_tokens, eos_hit):
        return {"collapse": collapse_flags(text, [1] * 23, max_new_tokens=max_new_tokens, eos_hit=eos_hit)}

    records = [
        _gen("a", "full", None, True, 60, 1.0, False, **flags("so \\boxed{3}", max_new_tokens=100, eos_hit=True)),
        _gen("b", "full", None, False, 100, 1.0, True, **flags("still going", max_new_tokens=23, eos_hit=False)),
        _gen("a", "epikv", 64, False, 23, 1.0, False, **flags("Let me think", max_new_tokens=100, eos_hit=True)),
        _gen("b", "epikv", 64, False, 23, 1.0, False, **flags("Well", max_new_tokens=100, eos_hit=True)),
    ]
    by = {r.policy: r for r in summarize(records)}
    assert (by["full"].collapse_rate, by["full"].early_stop_rate) == (0.5, 0.0)
    assert (by["epikv"].collapse_rate, by["epikv"].early_stop_rate) == (0.0, 1.0)
    text = markdown(list(by.values()))
    assert "| collapse rate | early stop rate |" in text and "| 23.0 | 1.0 | 0.000 | 1.000 |" in text


def test_markdown_table(results):
    text = markdown(summarize(load_results(results)), source="results.jsonl")
    lo, hi = _wilson_by_quadratic(1, 4)
    # streaming@128 against the full cache, problem by problem: a 0, b -1, c 0, d -1; 4 problems are too
    # few for a bootstrap interval, and two that agree say only that they agree
    assert "## gsm8k · m (max 100 new tokens; temperature 0), buffer B=64" in text
    full = "| full | — | 4 | 0 | 0.750 [0.301, 0.954] | 0.750 | — | — | 25.0 | 25.0 | 0.250 | — | — | — | — | — |"
    assert full in text
    assert (
        f"| streaming | 128 | 4 | 0 | 0.250 [{lo:.3f}, {hi:.3f}] | 0.250 | — | -0.500 (4 problems: too few for an "
        "interval) | 65.0 | 2.5 | 0.500 | — | 0.700 | 0.2 | -1.000 | -0.500 |" in text
    )
    assert (
        "| streaming | 256 | 2 | 0 | 1.000 [0.342, 1.000] | 1.000 | — | +0.000 (no problem differs, 2 problems) "
        "| 95.0 | 5.0 | 0.000 | — | 1.000 | 0 | +0.000 | +0.000 |" in text
    )
    assert "## math500 · m" in text
    assert text.count("| full |") == 2


def test_write_report_writes_table_summary_and_plots(results, tmp_path):
    out = tmp_path / "report"
    written = write_report(results, out)
    assert written["markdown"].read_text(encoding="utf-8").startswith("# Evaluation report")
    summary = json.loads(written["summary"].read_text(encoding="utf-8"))
    assert len(summary) == 4 and summary[1]["accuracy"] == 0.25 and summary[0]["top1_agreement"] is None
    names = sorted(p.name for p in written["plots"])
    # math500 holds the full cache alone: no evicting policy to plot, so no figure
    assert names == ["gsm8k-m-accuracy.png", "gsm8k-m-collapse.png", "gsm8k-m-fidelity.png", "gsm8k-m-throughput.png"]
    for path in written["plots"]:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    text = written["markdown"].read_text(encoding="utf-8")
    assert all(f"]({name})" in text for name in names)  # report.md shows its plots


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


# ---------------------------------------------------------------------------------- pass@k, pairing, errors


def test_pass_at_k_is_the_unbiased_estimator():
    from itertools import combinations

    for n, c in [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8)]:
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(combinations(outcomes, k))
            want = sum(any(s) for s in subsets) / len(subsets)  # chance that k of the n samples hold a correct one
            assert pass_at_k(n, c, k) == pytest.approx(want)
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def _sampled(problem, policy, budget, sample, correct, temperature=0.6):
    return _gen(problem, policy, budget, correct, 10, 1.0, False, sample=sample, temperature=temperature)


def test_sampled_rows_have_pass_at_k_and_a_difference_paired_by_sample():
    full = {("a", 0): 1, ("a", 1): 1, ("a", 2): 0, ("a", 3): 1, ("b", 0): 0, ("b", 1): 0, ("b", 2): 0, ("b", 3): 1}
    mine = {("a", 0): 1, ("a", 1): 0, ("a", 2): 0, ("a", 3): 0, ("b", 0): 1, ("b", 1): 0, ("b", 2): 0, ("b", 3): 0}
    records = [_sampled(p, "full", None, s, bool(v)) for (p, s), v in full.items()]
    records += [_sampled(p, "streaming", 128, s, bool(v)) for (p, s), v in mine.items()]
    rows = {r.policy: r for r in summarize(records)}
    row = rows["streaming"]
    assert row.samples == 4 and sorted(row.pass_at) == [1, 2, 4]
    assert row.pass_at[1] == pytest.approx((1 / 4 + 1 / 4) / 2)
    assert row.pass_at[2] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 1, 2)) / 2)
    assert row.pass_at[4] == 1.0
    # per problem: a: (0 + -1 + 0 + -1) / 4 = -0.5; b: (1 + 0 + 0 + -1) / 4 = 0
    assert row.paired_problems == 2 and row.delta == pytest.approx(-0.25)
    assert math.isnan(row.delta_low) and math.isnan(row.delta_high)  # 2 problems: too few for an interval
    assert rows["full"].pass_at[1] == pytest.approx((3 / 4 + 1 / 4) / 2) and math.isnan(rows["full"].delta)
    text = markdown(list(rows.values()))
    assert f"| {row.pass_at[1]:.3f} | 1.000 (k=4) | -0.250 (2 problems: too few for an interval) |" in text


def test_at_temperature_zero_every_sample_pairs_with_the_one_full_cache_answer():
    records = [_sampled("a", "full", None, 0, True, 0.0), _sampled("b", "full", None, 0, False, 0.0)]
    records += [_sampled("a", "random", 64, s, s == 0, 0.0) for s in range(2)]
    records += [_sampled("b", "random", 64, s, True, 0.0) for s in range(2)]
    row = next(r for r in summarize(records) if r.policy == "random")
    # a: (0 + -1) / 2; b: (1 + 1) / 2
    assert row.paired_problems == 2 and row.delta == pytest.approx((-0.5 + 1.0) / 2)


def test_a_cell_that_failed_shows_as_errors_not_zeros(tmp_path):
    def error(problem, budget, reason="ValueError: protect_prompt keeps the whole prompt"):
        record = _gen(problem, "raas", budget, None, None, None, None)
        return {**record, "kind": "error", "unit": "generation", "error": reason}

    records = RECORDS[:4] + [error(p, 16) for p in "abcd"]
    records += [error("a", 64), _gen("a", "raas", 64, True, 9, 1.0, False)]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    rows = {(r.policy, r.budget): r for r in summarize(load_results(path))}
    failed = rows["raas", 16]
    assert (failed.n, failed.errors) == (0, 4) and math.isnan(failed.accuracy)
    recovered = rows["raas", 64]  # a later result replaces the error of the same unit
    assert (recovered.n, recovered.errors, recovered.accuracy) == (1, 0, 1.0)
    text = markdown(list(rows.values()))
    assert "| raas | 16 | 0 | 4 | error | — |" in text
    assert "- raas@16: 4 units: ValueError: protect_prompt keeps the whole prompt" in text
    summary = json.loads(write_report(path, tmp_path / "report")["summary"].read_text(encoding="utf-8"))
    assert [(r["policy"], r["budget"], r["n"], r["errors"]) for r in summary if r["policy"] == "raas"] == [
        ("raas", 16, 0, 4),
        ("raas", 64, 1, 0),
    ]


# ---------------------------------------------------------------------------------- runs, shards, the folder


MANIFEST = {
    "kind": "manifest",
    "tool": "reasonkv",
    "id": None,  # set below, from its content
    "created": "2026-01-01T00:00:00+00:00",
    "setup": {"model": "m", "dtype": "fp32", "weights_sha256": "ab" * 32, "temperature": 0.0, "max_new_tokens": 100},
    "environment": {"reasonkv": "0.1.0", "git_commit": "c0ffee" * 6, "torch": "2.13.0", "transformers": "5.24.0"},
    "grid": {"datasets": [{"name": "gsm8k", "problems": 4, "samples": 1, "sha256": "cd" * 32}], "policies": []},
    "command": ["reasonkv", "eval", "--dataset", "gsm8k:4", "--out", "results.jsonl"],
    "launch": {"world_size": 2},
}
MANIFEST["id"] = manifest_id(MANIFEST)


def test_the_report_reads_a_run_from_its_shard_files_and_prints_its_manifest(tmp_path, capsys):
    from reasonkv.cli import main

    halves = [RECORDS[:6], RECORDS[6:]]
    for index, part in enumerate(halves):
        shard = tmp_path / f"results.shard-{index}-of-2.jsonl"
        shard.write_text("".join(json.dumps(r) + "\n" for r in [MANIFEST, *part]), encoding="utf-8")
    assert main(["report", str(tmp_path / "results.jsonl"), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "## Runs" in out and f"run `{MANIFEST['id']}`" in out and "2 processes" in out
    assert "model m, weights sha256 abababababab" in out and "git c0ffeec0ffee" in out
    assert "command: `reasonkv eval --dataset gsm8k:4 --out results.jsonl`" in out
    assert out.count("## Runs") == 1 and out.count(f"run `{MANIFEST['id']}`") == 1  # one run, two shard files
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in [MANIFEST, *RECORDS]), encoding="utf-8")
    assert summarize(load_results(tmp_path / "results.jsonl")) == summarize(load_results(whole))


EDITED_LINES = {
    "setup null": (1, {**MANIFEST, "setup": None}, "the manifest's field 'setup' must be an object, got null"),
    "grid null": (1, {**MANIFEST, "grid": None}, "the manifest's field 'grid' must be an object, got null"),
    "environment x": (1, {**MANIFEST, "environment": "x"}, "the manifest's field 'environment' must be an object"),
    "launch null": (1, {**MANIFEST, "launch": None}, "the manifest's field 'launch' must be an object"),
    "setup edited": (
        1,
        {**MANIFEST, "setup": {**MANIFEST["setup"], "dtype": "bf16"}},
        f"the manifest's id {MANIFEST['id']} does not match its content",
    ),
    "budget {}": (3, {**RECORDS[4], "budget": {}}, "field 'budget' must be a positive integer (or null), got {}"),
    "correct yes": (3, {**RECORDS[4], "correct": "yes"}, "field 'correct' must be true or false"),
    "no kind": (3, {k: v for k, v in RECORDS[4].items() if k != "kind"}, "field 'kind' must be one of"),
}


@pytest.mark.parametrize("edit", sorted(EDITED_LINES))
def test_a_line_edited_by_hand_is_one_line_naming_the_file_the_line_and_the_field(tmp_path, capsys, edit):
    from reasonkv.cli import main

    number, edited, message = EDITED_LINES[edit]
    lines = [MANIFEST, RECORDS[0], RECORDS[4]]
    lines[number - 1] = edited
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{path}, line {number}: {message}" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "report.md").exists()


@pytest.fixture
def small(tmp_path):
    """One section, one row: a report with few plots."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:4]), encoding="utf-8")
    return path


def test_the_report_folder_is_never_written_over_a_file_that_is_not_its_own(small, tmp_path):
    results = small
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("my own notes\n", encoding="utf-8")
    with pytest.raises(ValueError, match="report.md exists and was not written by `reasonkv report`"):
        write_report(results, out)
    assert (out / "report.md").read_text(encoding="utf-8") == "my own notes\n"
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]

    file = tmp_path / "a-file"
    file.write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        write_report(results, file)
    assert file.read_text(encoding="utf-8") == "x"

    shared = tmp_path / "shared"  # other files may share the folder: they are left alone
    shared.mkdir()
    (shared / "README.md").write_text("about these results\n", encoding="utf-8")
    write_report(results, shared)
    write_report(results, shared)  # its own files are rewritten
    assert (shared / "README.md").read_text(encoding="utf-8") == "about these results\n"
    marker = json.loads((shared / ".reasonkv.json").read_text(encoding="utf-8"))
    assert marker["command"] == "report" and "report.md" in marker["files"] and "README.md" not in marker["files"]

    inside = tmp_path / "inputs"  # an input is never an output
    inside.mkdir()
    (inside / "summary.json").write_text(results.read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ValueError, match="input"):
        write_report(inside / "summary.json", inside)


def test_a_report_folder_from_before_markers_is_adopted(small, tmp_path):
    results = small
    out = tmp_path / "old"
    write_report(results, out)
    (out / ".reasonkv.json").unlink()
    write_report(results, out)
    assert json.loads((out / ".reasonkv.json").read_text(encoding="utf-8"))["command"] == "report"
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / ".reasonkv.json").write_text(json.dumps({"tool": "reasonkv", "command": "bench", "files": []}))
    with pytest.raises(ValueError, match="holds the output of `reasonkv bench`"):
        write_report(results, bench)


def test_the_source_of_a_report_is_named_from_its_folder_not_by_the_machines_path(results, tmp_path):
    text = write_report(results, tmp_path / "report")["markdown"].read_text(encoding="utf-8")
    assert "Source: ../results.jsonl\n" in text and str(tmp_path) not in text
