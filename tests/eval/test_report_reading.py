"""What ``report`` reads: records tied to their run's setup, cut-off guesses, conflicts, bad records."""

from __future__ import annotations

import json
import math
import re

import pytest

from reasonkv.eval.context import Ledger
from reasonkv.eval.manifest import manifest_id
from reasonkv.eval.records import scan_results
from reasonkv.eval.report import BUNDLED_NOTE, markdown, write_report
from reasonkv.eval.report_rows import read_report_input, summarize
from reasonkv.models import BUNDLED


def _manifest(run: str, max_new_tokens: int) -> dict:
    setup = {"model": "m", "dtype": "fp32", "prompt_format": "chat", "max_new_tokens": max_new_tokens}
    setup |= {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "weights_sha256": "ab" * 32}
    environment = {"label": run}  # one manifest per label
    return {"kind": "manifest", "tool": "reasonkv", "id": run, "setup": setup, "environment": environment, "grid": {}}


def _unit(kind: str, run: str, problem: str, policy: str, budget: int | None, **fields) -> dict:
    record = {
        "kind": kind, "model": "m", "dtype": "fp32", "dataset": "gsm8k", "problem_id": problem, "policy": policy,
        "policy_label": policy, "policy_config": {"policy": policy}, "budget": budget,
        "buffer": None if budget is None else 16, "base_seed": 0, "prompt_format": "chat", "run": run,
    }  # fmt: skip
    return record | fields


def _gen(run: str, problem: str, policy: str, budget: int | None, max_new_tokens: int, correct: bool, **fields):
    sampling = {"sample": 0, "max_new_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    fields = {"output_tokens": 10, "tokens_per_second": 5.0, "collapsed": False, **fields}
    return _unit("generation", run, problem, policy, budget, **sampling, correct=correct, **fields)


def _fid(run: str, problem: str, policy: str, budget: int, top1: float, kl: float) -> dict:
    return _unit("fidelity", run, problem, policy, budget, fidelity_tokens=64, top1_agreement=top1, kl_mean=kl)


def _write(path, records) -> None:
    """Write ``records``, each manifest under its real id (a manifest's id is its content's hash; the tests
    name runs by labels), and each record's ``run`` as its manifest's id."""
    ids = {r["id"]: manifest_id(r) for r in records if r.get("kind") == "manifest"}
    records = [{**r, "id": ids[r["id"]]} if r.get("kind") == "manifest" else r for r in records]
    records = [{**r, "run": ids.get(r["run"], r["run"])} if "run" in r else r for r in records]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_every_record_joins_the_section_of_the_run_that_wrote_it(tmp_path):
    # a: 64 new tokens, streaming and h2o with fidelity; b: 16 new tokens, full, and raas failing everywhere
    a = [_manifest("aaaa", 64), _gen("aaaa", "p1", "full", None, 64, True)]
    a += [_gen("aaaa", "p1", policy, 64, 64, False) for policy in ("streaming", "h2o")]
    a += [_fid("aaaa", "p1", "streaming", 64, 0.859, 0.3035), _fid("aaaa", "p1", "h2o", 64, 0.9, 0.2)]
    b = [_manifest("bbbb", 16), _gen("bbbb", "p1", "full", None, 16, False)]
    error = {"unit": "generation", "error": "ValueError: protect_prompt"}
    b += [_unit("error", "bbbb", "p1", "raas", 48, sample=0, max_new_tokens=16, temperature=0.0, **error)]
    b += [_unit("error", "bbbb", "p1", "raas", 48, fidelity_tokens=16, **(error | {"unit": "fidelity"}))]
    _write(tmp_path / "a.jsonl", a)
    _write(tmp_path / "b.jsonl", b)

    written = write_report([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "report")
    rows = {(r.section.max_new_tokens, r.policy, r.budget): r for r in written["rows"]}
    assert set(rows) == {
        (64, "full", None),
        (64, "streaming", 64),
        (64, "h2o", 64),
        (16, "full", None),
        (16, "raas", 48),
    }
    assert rows[64, "streaming", 64].top1_agreement == 0.859 and rows[64, "streaming", 64].kl_mean == 0.3035
    assert (rows[16, "raas", 48].errors, rows[16, "raas", 48].fidelity_n) == (1, 0)  # its two units: one problem

    text = written["markdown"].read_text(encoding="utf-8")
    assert text.index("These results come from 2 setups") < text.index("## Runs")
    assert "they differ in max new tokens (64, 16)" in text
    sixteen = text[text.index("## gsm8k · m (max 16 new tokens") :]
    assert "streaming" not in sixteen and "- raas@48: 1 unit: ValueError: protect_prompt" in sixteen
    sixty_four = text[text.index("## gsm8k · m (max 64 new tokens") : text.index("## gsm8k · m (max 16")]
    assert "raas" not in sixty_four
    # the plots say which setup they are (max64 / max16), and the all-error setup has none
    assert sorted(p.name for p in written["plots"]) == [
        "gsm8k-m-max64-accuracy.png",
        "gsm8k-m-max64-collapse.png",
        "gsm8k-m-max64-fidelity.png",
        "gsm8k-m-max64-throughput.png",
    ]


def test_one_setup_says_nothing_about_setups(tmp_path):
    _write(tmp_path / "a.jsonl", [_manifest("aaaa", 64), _gen("aaaa", "p1", "full", None, 64, True)])
    text = write_report(tmp_path / "a.jsonl", tmp_path / "report")["markdown"].read_text(encoding="utf-8")
    assert "setups" not in text


def test_a_last_number_from_an_output_cut_off_at_the_token_limit_is_not_correct(tmp_path):
    cut = {"grading_method": "last_number", "finish_reason": "length", "extracted_answer": "3"}
    ended = {"grading_method": "last_number", "finish_reason": "eos", "extracted_answer": "18"}
    boxed = {"grading_method": "boxed", "finish_reason": "length", "extracted_answer": "18"}
    records = [_manifest("aaaa", 64)]
    records += [_gen("aaaa", "p1", "full", None, 64, False, **cut), _gen("aaaa", "p2", "full", None, 64, False)]
    # graded correct before the rule: the cut-off guess, a complete output's last number, a boxed answer
    records += [_gen("aaaa", "p1", "snapkv", 64, 64, True, **cut), _gen("aaaa", "p2", "snapkv", 64, 64, True, **ended)]
    records += [_gen("aaaa", "p3", "snapkv", 64, 64, True, **boxed)]
    _write(tmp_path / "a.jsonl", records)
    written = write_report(tmp_path / "a.jsonl", tmp_path / "report")
    snapkv = next(r for r in written["rows"] if r.policy == "snapkv")
    assert (snapkv.n, snapkv.correct, snapkv.last_number, snapkv.cut_off) == (3, 2, 1, 1)
    assert snapkv.accuracy == pytest.approx(2 / 3)
    assert snapkv.delta == pytest.approx(0.5)  # p1: 0 - 0, p2: 1 - 0; p3 has no full-cache answer to pair with
    text = written["markdown"].read_text(encoding="utf-8")
    assert (
        "- snapkv@64: 1 of its 2 correct answers; 1 from an output cut off at the token limit, graded correct when "
        "written, not counted correct" in text
    )


def test_two_results_of_one_unit_that_differ_are_left_out_and_listed(tmp_path, capsys):
    records = [_manifest("aaaa", 64), _gen("aaaa", "p1", "full", None, 64, False)]
    records += [_gen("aaaa", p, "streaming", 64, 64, False) for p in ("p1", "p2", "p3")]
    _write(tmp_path / "a.jsonl", records)
    again = [_manifest("aaaa", 64), _gen("aaaa", "p1", "streaming", 64, 64, True)]  # the same unit, now correct
    again += [_gen("aaaa", "p2", "streaming", 64, 64, False, tokens_per_second=9.0)]  # the same result: once
    _write(tmp_path / "b.jsonl", again)

    read = read_report_input([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    [conflict] = read.conflicts
    assert conflict.fields == ["correct"] and conflict.record["problem_id"] == "p1"
    assert conflict.places == [f"{tmp_path / 'a.jsonl'}, line 3", f"{tmp_path / 'b.jsonl'}, line 2"]
    streaming = next(r for r in summarize(read.records + read.manifests, read.conflicts) if r.policy == "streaming")
    assert (streaming.n, streaming.correct, streaming.conflicts) == (2, 0, 1)  # never "last wins" (1 of 3)
    text = markdown(summarize(read.records + read.manifests, read.conflicts), conflicts=read.conflicts)
    assert (
        "**1 unit has conflicting records**" in text and "gsm8k p1 streaming@64 (generation): differ in correct" in text
    )
    assert "| streaming | 64 | 2 | 0 (+1 conflicting) |" in text

    ledger = Ledger()  # eval, resuming from the same files, says so too
    for path in (tmp_path / "a.jsonl", tmp_path / "b.jsonl"):
        scan_results(path, ledger.note)
    assert list(ledger.conflicts.values()) == [["correct"]]
    assert "two results of gsm8k p1 streaming@64 differ in correct" in capsys.readouterr().err


def _without_kind(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "kind"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_gen("aaaa", "p2", "full", None, 64, "yes"), "field 'correct' must be true or false, got \"yes\""),
        (
            _without_kind(_gen("aaaa", "p2", "full", None, 64, True)),
            "field 'kind' must be one of manifest, generation, fidelity, error, got null",
        ),
        (_gen("aaaa", "p2", "streaming", {}, 64, True), "field 'budget' must be a positive integer (or null), got {}"),
        (
            _fid("aaaa", "p2", "h2o", 64, 1.5, 0.1),
            "field 'top1_agreement' must be a number between 0 and 1 (or null), got 1.5",
        ),
    ],
)
def test_report_and_eval_refuse_a_bad_record_alike_naming_its_line(tmp_path, bad, message):
    path = tmp_path / "a.jsonl"
    _write(path, [_manifest("aaaa", 64), _gen("aaaa", "p1", "full", None, 64, True), bad])
    with pytest.raises(ValueError, match="line 3") as reported:
        write_report(path, tmp_path / "report")
    with pytest.raises(ValueError, match="line 3") as resumed:
        scan_results(path, lambda record: None)
    for error in (reported.value, resumed.value):
        assert message in str(error) and str(path) in str(error)
    assert not (tmp_path / "report" / "report.md").exists()


def test_fidelity_means_carry_a_95_percent_interval_over_problems(tmp_path):
    top1 = [0.8, 0.9, 0.7, 1.0]
    records = [_manifest("aaaa", 64)] + [_fid("aaaa", f"p{i}", "h2o", 64, t, 0.1 * i + 0.1) for i, t in enumerate(top1)]
    _write(tmp_path / "a.jsonl", records)
    [row] = write_report(tmp_path / "a.jsonl", tmp_path / "report")["rows"]
    half = 1.959963984540054 * 0.12909944487358055 / 2  # z x stdev / sqrt(4)
    assert row.top1_agreement == pytest.approx(0.85)
    assert (row.top1_low, row.top1_high) == pytest.approx((0.85 - half, 0.85 + half))
    assert row.kl_low < row.kl_mean < row.kl_high and math.isnan(row.accuracy)


def test_a_report_of_a_bundled_model_says_it_is_a_dequantized_q4_file(tmp_path):
    for name, note in BUNDLED_NOTE.items():  # the notes name the quantization of the files the models load from
        [quantization] = re.findall(r"Q4_[A-Z0-9_]+", note)
        assert quantization.lower() in BUNDLED[name].gguf.lower()
    record = {**_gen("aaaa", "p1", "full", None, 64, True), "model": "smollm2-135m"}
    manifest = _manifest("aaaa", 64)
    manifest["setup"]["model"] = "smollm2-135m"
    _write(tmp_path / "a.jsonl", [manifest, record])
    text = write_report(tmp_path / "a.jsonl", tmp_path / "report")["markdown"].read_text(encoding="utf-8")
    assert "`smollm2-135m` is SmolLM2-135M-Instruct from a Q4_1 GGUF file, dequantized on load" in text
