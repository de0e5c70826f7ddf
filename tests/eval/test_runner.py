"""The eval grid runner: records, batching, seeds, options, validation, and resuming after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reasonkv
import reasonkv.eval.decoding
import reasonkv.generation.loop
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval import collapse_flags, grade, load_dataset
from reasonkv.eval.grid import make_cells, parse_dataset_spec, policy_options
from reasonkv.eval.records import record_key
from reasonkv.eval.runner import run_grid
from reasonkv.eval.units import sample_seed
from reasonkv.generation.loop import GenerationResult
from reasonkv.runs.store import read_records

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO = TESTS_DIR.parent

PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2?", "answer": "4", "solution": "2+2 = <<2+2=4>>4.\n#### 4"},
    {"id": "p2", "problem": "Half of 10?", "answer": "5", "solution": "Half of ten is \\boxed{5}."},
    {"id": "p3", "problem": "Say seven.", "answer": "7"},
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def _grid(dataset: str, out, **overrides) -> dict:
    kwargs = dict(
        dataset=dataset,
        out=str(out),
        policies="full,streaming,random",
        budgets=[10, 16],
        buffer=4,
        max_new_tokens=20,
        batch_size=4,
        progress=False,
    )
    kwargs.update(overrides)
    return kwargs


def _keys(records):
    return [record_key(r) for r in records]


def results_of(path) -> list[dict]:
    """The records of a results file after its manifest (each run writes one first)."""
    records = read_records(path)
    assert records[0]["kind"] == "manifest"
    return [r for r in records if r["kind"] != "manifest"]


# ---------------------------------------------------------------------------------- records


def test_grid_writes_one_record_per_problem_policy_budget_sample(dataset, tmp_path):
    out = tmp_path / "results.jsonl"
    result = run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out, samples=2, fidelity=True))
    records = results_of(out)
    generations = [r for r in records if r["kind"] == "generation"]
    fidelity = [r for r in records if r["kind"] == "fidelity"]
    # temperature 0: full and streaming are deterministic (1 sample), random is stochastic (2 samples)
    cells = {(r["policy"], r["budget"]) for r in generations}
    assert cells == {("full", None), ("streaming", 10), ("streaming", 16), ("random", 10), ("random", 16)}
    assert len(generations) == 3 * (1 + 2 + 2 * 2) == result.generated
    assert len(fidelity) == 3 * 4 == result.fidelity  # every evicting cell, every problem
    assert len(set(_keys(records))) == len(records)
    problems = {p.id: p for p in load_dataset(dataset)}
    for r in generations:
        problem = problems[r["problem_id"]]
        assert r["seed"] == sample_seed(0, r["problem_id"], r["sample"])
        assert r["model"] == "LlamaForCausalLM" and r["dtype"] == "fp32"
        assert r["policy_config"] == reasonkv.get_policy(r["policy"]).config()
        assert r["output_tokens"] == len(r["output_ids"]) == 20
        assert r["finish_reason"] == "length"
        verdict = grade(r["output_text"], problem, complete=False)  # cut off at 20 tokens: no last-number guess
        assert (r["correct"], r["extracted_answer"], r["grading_method"]) == (
            verdict.correct,
            verdict.extracted,
            verdict.method,
        )
        assert r["collapse"] == collapse_flags(r["output_text"], r["output_ids"], max_new_tokens=20, eos_hit=False)
        assert r["collapsed"] == r["collapse"]["collapsed"]
        assert r["prompt_tokens"] == _prompt_len({"problem": problem.problem})  # the plain prompt format
        if r["policy"] == "full":
            assert r["budget"] is None and r["buffer"] is None and r["evictions"] == 0
            assert r["peak_row_tokens"] == r["prompt_tokens"] + 19
        else:
            assert r["evictions"] > 0  # the prompt alone exceeds K + B
            assert r["peak_row_tokens"] == max(r["prompt_tokens"], r["budget"] + 4)
        for name in ("seconds", "tokens_per_second", "peak_memory_bytes", "peak_cache_slots", "peak_kv_bytes"):
            assert r[name] > 0
    for r in fidelity:
        assert 0 <= r["top1_agreement"] <= 1 and r["kl_mean"] >= 0
        assert r["top1_full_replay"] == 1.0
        assert r["trace_source"] == "generation"  # reused the greedy full-cache records
        assert r["chunked"] is True
        has_reference = r["problem_id"] != "p3"
        assert (r["answer_logprob_delta"] is not None) == has_reference


def _prompt_len(problem: dict) -> int:
    instruction = "Please reason step by step, and put the final answer in \\boxed{}."
    text = f"Problem: {problem['problem']}\n\n{instruction}\nSolution:"
    return len(NoEosTokenizer()(text)["input_ids"])


def test_records_hold_the_grade_of_the_output(dataset, tmp_path, monkeypatch):
    outputs = {"p1": "so 2+2 is \\boxed{4}", "p2": "The answer is 6.", "p3": ""}
    by_length = {_prompt_len(p): p["id"] for p in PROBLEMS}
    assert len(by_length) == 3

    def fake_generate(model, tokenizer, prompts, **kwargs):
        stats = dict(evictions=0, peak_slots=99, peak_row_tokens=9, prefill_seconds=0.1, decode_seconds=0.2)
        stats.update(tokens_per_second=5.0, batch_size=len(prompts), peak_kv_bytes=1, peak_memory_bytes=1)
        return [GenerationResult(outputs[by_length[len(ids)]], [5, 6, 7, 2], len(ids), "eos", stats) for ids in prompts]

    monkeypatch.setattr(reasonkv.eval.decoding, "generate", fake_generate)
    out = tmp_path / "r.jsonl"
    run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out, policies="full", fidelity=False))
    by_id = {r["problem_id"]: r for r in results_of(out)}
    p1, p2, p3 = by_id["p1"], by_id["p2"], by_id["p3"]
    assert (p1["correct"], p1["extracted_answer"], p1["grading_method"]) == (True, "4", "boxed")
    assert (p2["correct"], p2["extracted_answer"], p2["grading_method"]) == (False, "6", "answer_is")
    assert p3["correct"] is False and p3["collapse"]["empty"] and p3["collapsed"]
    assert p1["finish_reason"] == "eos" and not p1["collapse"]["max_tokens"] and not p1["collapsed"]
    assert p1["seconds"] == pytest.approx(0.3) and p1["output_tokens"] == 4


def test_batch_size_does_not_change_any_output(dataset, tmp_path):
    model = tiny_llama()
    kwargs = dict(temperature=0.8, top_k=20, samples=2, fidelity=False)
    run_grid(model, NoEosTokenizer(), **_grid(dataset, tmp_path / "a.jsonl", batch_size=1, **kwargs))
    run_grid(model, NoEosTokenizer(), **_grid(dataset, tmp_path / "b.jsonl", batch_size=5, **kwargs))
    alone = {record_key(r): r["output_ids"] for r in results_of(tmp_path / "a.jsonl")}
    batched = {record_key(r): r["output_ids"] for r in results_of(tmp_path / "b.jsonl")}
    assert alone == batched
    assert len(alone) == 3 * 5 * 2
    samples = [
        r["output_ids"] for r in results_of(tmp_path / "a.jsonl") if (r["problem_id"], r["policy"]) == ("p1", "full")
    ]
    assert len(samples) == 2 and samples[0] != samples[1]  # the two samples differ


@pytest.mark.slow
def test_compiled_decode_writes_the_records_eager_decode_writes(dataset, tmp_path, monkeypatch):
    # aot_eager traces the step as inductor does, without generating code (seconds, not minutes).
    monkeypatch.setattr(reasonkv.generation.loop, "compile_backend", lambda compile: "aot_eager" if compile else None)
    model = tiny_llama()
    kwargs = dict(fidelity=False, budgets=[10], max_new_tokens=24)
    run_grid(model, NoEosTokenizer(), **_grid(dataset, tmp_path / "eager.jsonl", **kwargs))
    run_grid(model, NoEosTokenizer(), **_grid(dataset, tmp_path / "compiled.jsonl", compile=True, **kwargs))
    eager, compiled = results_of(tmp_path / "eager.jsonl"), results_of(tmp_path / "compiled.jsonl")
    assert {record_key(r): r["output_ids"] for r in compiled} == {record_key(r): r["output_ids"] for r in eager}
    assert all(r["compiled"] for r in compiled) and not any(r["compiled"] for r in eager)
    assert max(r["evictions"] for r in compiled) >= 2
    [manifest] = [r for r in read_records(tmp_path / "compiled.jsonl") if r.get("kind") == "manifest"]
    assert manifest["grid"]["compile"] is True
    # Speed, not results: the same file resumes with or without it, and nothing is left to do.
    done = run_grid(model, NoEosTokenizer(), **_grid(dataset, tmp_path / "compiled.jsonl", **kwargs))
    assert len(results_of(tmp_path / "compiled.jsonl")) == len(compiled), done


def test_sample_seed_is_the_documented_hash():
    digest = hashlib.sha256(b"3/gsm8k-test-0001/2").digest()
    assert sample_seed(3, "gsm8k-test-0001", 2) == int.from_bytes(digest[:4], "big") % 2**31
    assert len({sample_seed(0, "a", s) for s in range(50)}) == 50


# ---------------------------------------------------------------------------------- resume


_CHILD = """
import json, os, signal, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.runner import run_grid
count = 0
def on_record(record):
    global count
    count += 1
    if count == {kill_after}:
        os.kill(os.getpid(), signal.SIGKILL)
run_grid(tiny_llama(), NoEosTokenizer(), on_record=on_record, **json.loads({kwargs!r}))
"""


@pytest.mark.slow
def test_a_killed_run_resumes_without_losing_or_duplicating(dataset, tmp_path):
    out = tmp_path / "results.jsonl"
    kwargs = _grid(dataset, out, temperature=0.7, samples=2, fidelity=True)
    code = _CHILD.format(tests=str(TESTS_DIR), kill_after=7, kwargs=json.dumps(kwargs))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    before = results_of(out)
    assert len(before) == 7  # every record written before the kill is on disk

    model = tiny_llama()
    result = run_grid(model, NoEosTokenizer(), **kwargs)
    assert result.skipped == 7
    after = results_of(out)
    assert after[:7] == before
    keys = _keys(after)
    assert len(keys) == len(set(keys)) == 3 * 5 * 2 + 3 * 4

    reference = tmp_path / "uninterrupted.jsonl"
    run_grid(model, NoEosTokenizer(), **{**kwargs, "out": str(reference)})
    want = {record_key(r): r for r in results_of(reference)}
    assert set(want) == set(keys)
    for r in after:
        w = want[record_key(r)]
        if r["kind"] == "generation":
            assert r["output_ids"] == w["output_ids"] and r["correct"] == w["correct"]
        else:
            assert r["top1_agreement"] == pytest.approx(w["top1_agreement"])
            assert r["kl_mean"] == pytest.approx(w["kl_mean"], rel=1e-4, abs=1e-7)


class Boom(RuntimeError):
    pass


def test_an_interrupted_fidelity_phase_and_a_torn_last_line_resume_cleanly(dataset, tmp_path):
    out = tmp_path / "results.jsonl"
    model = tiny_llama()
    kwargs = _grid(dataset, out, policies="full,streaming", budgets=[10], fidelity=True)
    seen = []

    def explode(record):
        seen.append(record)
        if len(seen) == 7:  # 3 full + 3 streaming generation records, then the first fidelity record
            raise Boom

    with pytest.raises(Boom):
        run_grid(model, NoEosTokenizer(), on_record=explode, **kwargs)
    assert [r["kind"] for r in results_of(out)] == ["generation"] * 6 + ["fidelity"]

    torn = '{"kind": "fidelity", "model": "LlamaForCausalLM", "problem_id": "p3", "top1_agr'
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(torn)
    assert len(results_of(out)) == 7  # the torn line is not a record
    result = run_grid(model, NoEosTokenizer(), **kwargs)
    records = results_of(out)
    assert (result.skipped, result.generated, result.fidelity) == (7, 0, 2)
    assert torn not in out.read_text()
    assert len(records) == len(set(_keys(records))) == 9
    assert {r["problem_id"] for r in records if r["kind"] == "fidelity"} == {"p1", "p2", "p3"}
    # the closing summary shows fidelity beside accuracy, over the replays done before the interruption too
    replays = [r for r in records if r["kind"] == "fidelity"]
    top1 = sum(r["top1_agreement"] for r in replays) / 3
    kl = sum(r["kl_mean"] for r in replays) / 3
    [line] = [line for line in result.summary().splitlines() if "streaming@10" in line]
    assert f"accuracy 0/3 = 0.000; top-1 agreement {top1:.3f}, KL {kl:.4f} (3 replays)" in line


def test_changed_settings_are_new_work_not_skipped(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    model = tiny_llama()
    run_grid(model, NoEosTokenizer(), **_grid(dataset, out, policies="streaming", budgets=[10], fidelity=False))
    again = run_grid(
        model,
        NoEosTokenizer(),
        **_grid(dataset, out, policies="streaming", budgets=[10, 12], fidelity=False, options=["sinks=2"]),
    )
    # sinks=2 is a different policy configuration: all of it runs
    assert again.skipped == 0 and again.generated == 6
    labels = {r["policy_label"] for r in results_of(out)}
    assert labels == {"streaming", "streaming[sinks=2]"}


# ---------------------------------------------------------------------------------- options and validation


def test_options_go_to_the_policies_that_have_them():
    options = policy_options(["full", "streaming", "random"], ["sinks=2", "random.window=3"])
    assert options == {"full": {}, "streaming": {"sinks": 2}, "random": {"sinks": 2, "window": 3}}
    cells = make_cells(["full", "streaming", "random"], [16], 4, ["sinks=2", "random.window=3"])
    assert [c.name for c in cells] == ["full", "streaming[sinks=2]@16", "random[sinks=2,window=3]@16"]
    assert cells[2].config == {"policy": "random", "sinks": 2, "window": 3, "protect_prompt": False}
    assert cells[0].config == reasonkv.get_policy("full").config()


def test_a_policy_option_named_like_a_sampling_argument_reaches_the_policy(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    options = ["vase-attnv.temperature=0.5", "query_window=4", "window=4"]
    kwargs = _grid(dataset, out, policies="vase-attnv", budgets=[40], limit=1, max_new_tokens=8, options=options)
    run_grid(tiny_llama(), NoEosTokenizer(), **kwargs)
    records = results_of(out)
    assert {r["kind"] for r in records} == {"generation", "fidelity"}
    for r in records:
        assert r["policy_config"]["temperature"] == 0.5 and r["policy_config"]["query_window"] == 4
        assert r["policy_label"] == "vase-attnv[query_window=4,temperature=0.5,window=4]"
    assert records[0]["temperature"] == 0.0 and records[0]["evictions"] > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(dataset="no-such-set"), "unknown dataset"),
        (dict(policies="full,nope"), "unknown policy 'nope'"),
        (dict(policies="streaming,streaming"), "listed twice"),
        (dict(budgets=[0]), "budgets must be positive"),
        (dict(budgets=[16, 16]), "budget listed twice"),
        (dict(budgets=[]), "give at least one budget"),
        (dict(budgets=[3]), "exceed the budget 3"),
        (dict(buffer=-1), "buffer must be"),
        (dict(samples=0), "samples must be"),
        (dict(batch_size=0), "batch_size must be"),
        (dict(max_new_tokens=0), "max_new_tokens must be"),
        (dict(temperature=-0.5), "temperature must be"),
        (dict(top_p=0.0), "top_p must be"),
        (dict(limit=0), "limit must be a positive"),
        (dict(options=["nonsense=1"]), "no selected policy has an option 'nonsense'"),
        (dict(options=["h2o.sinks=1"]), "names policy 'h2o', which is not selected"),
        (dict(options=["sinks=many"]), "expected int"),
        (dict(options=["sinks"]), "not KEY=VALUE"),
    ],
)
def test_bad_arguments_fail_before_any_model_is_loaded(dataset, tmp_path, overrides, message):
    kwargs = _grid(dataset, tmp_path / "r.jsonl")
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        run_grid(None, None, **kwargs)
    assert not (tmp_path / "r.jsonl").exists()


def test_dataset_specs():
    assert parse_dataset_spec("gsm8k:40,math500:20", 5) == [("gsm8k", 40), ("math500", 20)]
    assert parse_dataset_spec(["aime24"], None) == [("aime24", None)]
    assert parse_dataset_spec("data/x.jsonl", 3) == [("data/x.jsonl", 3)]
    with pytest.raises(ValueError, match="listed twice"):
        parse_dataset_spec("gsm8k,gsm8k")


def test_cli_reports_bad_arguments_with_exit_code_2(tmp_path, capsys):
    from reasonkv.cli import main

    code = main(["eval", "--dataset", "nope", "--out", str(tmp_path / "r.jsonl"), "--no-progress"])
    assert code == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    code = main(["eval", "--dataset", "gsm8k", "--budgets", "-4", "--out", str(tmp_path / "r.jsonl")])
    assert code == 2
    assert "budgets must be positive" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- end to end


@pytest.mark.integration
def test_reasonkv_eval_and_report_on_the_bundled_model(tmp_path, capsys):
    from reasonkv.cli import main

    out = tmp_path / "results.jsonl"
    argv = [
        "eval", "--dataset", "gsm8k", "--limit", "2", "--policies", "full,streaming", "--budgets", "64",
        "--buffer", "16", "--max-new-tokens", "48", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    records = results_of(out)
    generations = [r for r in records if r["kind"] == "generation"]
    fidelity = [r for r in records if r["kind"] == "fidelity"]
    assert len(generations) == 4 and len(fidelity) == 2
    assert {r["model"] for r in records} == {"smollm2-135m"}
    assert all(r["evictions"] > 0 for r in generations if r["policy"] == "streaming")
    assert all(r["output_tokens"] <= 48 for r in generations)
    for r in fidelity:
        assert r["trace_source"] == "generation"
        assert 0 <= r["top1_agreement"] <= 1 and r["answer_logprob_delta"] is not None
    assert all(r["policy_seconds"]["score"] > 0 for r in generations if r["policy"] == "streaming")
    assert main(["report", str(out), "--out", str(tmp_path / "report"), "--quiet"]) == 0
    assert (tmp_path / "report" / "report.md").read_text().count("| streaming | 64 |") == 1
