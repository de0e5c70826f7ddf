"""One bad cell does not sink a grid: error records instead of aborting, checked up front where possible."""

from __future__ import annotations

import json

import pytest

import reasonkv
import reasonkv.eval.decoding
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval import fidelity as fid
from reasonkv.eval.report import load_results, summarize
from reasonkv.eval.runner import run_grid
from reasonkv.runs.store import read_records

LONG = "Please add the following numbers carefully, one after another, and explain: 2+2?"
PROBLEMS = [
    {"id": "short", "problem": "2+2?", "answer": "4", "solution": "2+2 = \\boxed{4}"},
    {"id": "long", "problem": LONG, "answer": "4", "solution": "2+2 = \\boxed{4}"},
]
BUDGET = 100  # the short prompt (95 tokens) fits, the long one does not

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def _grid(dataset, out, **overrides) -> dict:
    kwargs = dict(
        dataset=dataset, out=str(out), policies="full,raas,streaming", budgets=[BUDGET], buffer=4,
        max_new_tokens=8, batch_size=4, progress=False, fidelity=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


def _by_kind(path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in read_records(path):
        out.setdefault(r["kind"], []).append(r)
    return out


def test_a_prompt_that_protect_prompt_cannot_fit_is_an_error_and_the_rest_of_the_grid_runs(dataset, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    model = tiny_llama()
    result = run_grid(model, NoEosTokenizer(), **_grid(dataset, out))
    records = _by_kind(out)
    errors = records["error"]
    assert [(e["unit"], e["problem_id"], e["policy"], e["stage"]) for e in errors] == [
        ("generation", "long", "raas", "generation"),
        ("fidelity", "long", "raas", "fidelity"),
    ]
    long_prompt = len(NoEosTokenizer()(f"Problem: {LONG}\n\nPlease reason")["input_ids"])
    assert all("checked before decoding: protect_prompt keeps the whole prompt" in e["error"] for e in errors)
    assert all(f"more than the budget {BUDGET}" in e["error"] and long_prompt < BUDGET + 80 for e in errors)
    ran = {(r["problem_id"], r["policy"]) for r in records["generation"]}
    assert ran == {
        ("short", "full"),
        ("long", "full"),
        ("short", "raas"),
        ("short", "streaming"),
        ("long", "streaming"),
    }
    assert {(r["problem_id"], r["policy"]) for r in records["fidelity"]} == {
        ("short", "raas"),
        ("short", "streaming"),
        ("long", "streaming"),
    }
    # two error records (its generation and its fidelity unit), one problem that failed: said and counted once
    assert (result.errors, result.failed, result.complete) == (2, 1, True)
    assert capsys.readouterr().err.count("long raas@100: checked before decoding") == 1
    assert "1 units failed" in result.summary()

    rows = {r.policy: r for r in summarize(load_results(out))}
    assert (rows["raas"].n, rows["raas"].errors) == (1, 1) and rows["streaming"].errors == 0

    before = out.read_bytes()
    again = run_grid(model, NoEosTokenizer(), **_grid(dataset, out))  # an error settles its unit: not redone
    assert (again.generated, again.errors, again.failed) == (0, 0, 1) and out.read_bytes() == before
    retried = run_grid(model, NoEosTokenizer(), **_grid(dataset, out), retry_errors=True)
    assert (retried.generated, retried.errors) == (0, 2)  # tried again, still too long
    assert summarize(load_results(out)) == summarize(load_results(tmp_path / "r.jsonl"))
    assert {r.policy: r.errors for r in summarize(load_results(out))}["raas"] == 1  # the latest error per unit


def test_the_command_line_runs_every_cell_and_exits_1_when_units_failed(dataset, tmp_path, capsys, monkeypatch):
    from reasonkv.cli import eval as eval_command
    from reasonkv.cli import main

    real = eval_command.run_grid  # patched where the command looks it up, so the patch is undone there too
    monkeypatch.setattr(eval_command, "run_grid", lambda name, **kw: real(tiny_llama(), NoEosTokenizer(), **kw))
    argv = ["eval", "--dataset", dataset, "--policies", "raas,streaming", "--budgets", str(BUDGET), "--buffer", "4"]
    argv += ["--max-new-tokens", "8", "--no-fidelity", "--no-progress", "--out", str(tmp_path / "r.jsonl")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "long raas@100: checked before decoding" in err and "1 units failed" in err
    assert {r["policy"] for r in _by_kind(tmp_path / "r.jsonl")["generation"]} == {"raas", "streaming"}


def test_a_unit_that_fails_while_decoding_costs_its_batch_nothing_and_is_retried_on_request(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    model = tiny_llama()
    real_generate, real_trace = reasonkv.generate, fid.trace_fidelity
    instruction = "Please reason step by step, and put the final answer in \\boxed{}."
    short_prompt = len(NoEosTokenizer()(f"Problem: 2+2?\n\n{instruction}\nSolution:")["input_ids"])

    def generate(model, tokenizer, prompts, **kwargs):
        if kwargs["spec"].evicts and any(len(p) > short_prompt for p in prompts):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_generate(model, tokenizer, prompts, **kwargs)

    def trace_fidelity(model, prompts, traces, **kwargs):
        if any(len(p) > short_prompt for p in prompts):
            raise RuntimeError("replay failed (simulated)")
        return real_trace(model, prompts, traces, **kwargs)

    grid = _grid(dataset, out, policies="full,streaming")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reasonkv.eval.decoding, "generate", generate)
        patch.setattr(fid, "trace_fidelity", trace_fidelity)
        result = run_grid(model, NoEosTokenizer(), **grid)
    records = _by_kind(out)
    assert [(e["unit"], e["problem_id"], e["error"]) for e in records["error"]] == [
        ("generation", "long", "RuntimeError: CUDA out of memory (simulated)"),
        ("fidelity", "long", "RuntimeError: replay failed (simulated)"),
    ]
    # the short prompt shared both batches and still has its records
    assert {(r["kind"], r["problem_id"], r["policy"]) for r in records["generation"] + records["fidelity"]} == {
        ("generation", "short", "full"),
        ("generation", "long", "full"),
        ("generation", "short", "streaming"),
        ("fidelity", "short", "streaming"),
    }
    assert result.failed == 1  # one problem's generation and fidelity units

    retried = run_grid(model, NoEosTokenizer(), **grid, retry_errors=True)  # the failure is gone now
    assert (retried.generated, retried.fidelity, retried.errors, retried.failed) == (1, 1, 0, 0)
    rows = {r.policy: r for r in summarize(load_results(out))}
    assert (rows["streaming"].n, rows["streaming"].errors, rows["streaming"].fidelity_n) == (2, 0, 2)


def test_a_prompt_beyond_the_models_context_is_an_error_unit_before_anything_is_decoded(tmp_path):
    model = tiny_llama()  # max_position_embeddings 1024
    huge = {"id": "huge", "problem": "Add these: " + "1+" * 600 + "1", "answer": "601", "solution": "\\boxed{601}"}
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in [PROBLEMS[0], huge]), encoding="utf-8")
    real_generate = reasonkv.eval.decoding.generate
    decoded = []

    def generate(model, tokenizer, prompts, **kwargs):
        decoded.extend(len(p) for p in prompts)
        return real_generate(model, tokenizer, prompts, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reasonkv.eval.decoding, "generate", generate)
        result = run_grid(model, NoEosTokenizer(), **_grid(str(path), tmp_path / "r.jsonl", policies="full,streaming"))
    assert decoded and max(decoded) < 300  # the short prompt only
    records = _by_kind(tmp_path / "r.jsonl")
    errors = {(e["unit"], e["policy"]): e["error"] for e in records["error"]}
    assert set(errors) == {("generation", "full"), ("generation", "streaming"), ("fidelity", "streaming")}
    prompt = len(NoEosTokenizer()(f"Problem: {huge['problem']}\n\nPlease reason")["input_ids"])
    for error in errors.values():
        assert (
            error.startswith("checked before decoding: the prompt (") and "exceed the model's context of 1,024" in error
        )
        assert int(error.split("(")[1].split(" ")[0].replace(",", "")) > prompt  # the prompt's own token count
    assert {r["problem_id"] for r in records["generation"]} == {"short"}
    assert result.failed == 2  # full's generation; streaming's generation and fidelity of one problem count once
