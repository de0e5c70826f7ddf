"""lm-evaluation-harness's ``reasonkv`` model on the bundled SmolLM2, run by lm-eval's own evaluator on reasonkv's
local tasks, and checked against lm-eval's own ``hf`` model (code written by others)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import reasonkv
from reasonkv.cli import main
from reasonkv.models.bundled import cache_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from reasonkv.integrations.lm_eval import TASKS_DIR, ReasonKVLM  # noqa: E402

TASKS = ["reasonkv_gsm8k", "reasonkv_gsm8k_reference"]
LIMIT, NEW_TOKENS = 3, 32
BUDGET, BUFFER = 32, 8  # K + B = 40: every chat-formatted GSM8K prompt (75+ tokens) exceeds it


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(lm, task_manager) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        task_manager=task_manager,
        limit=LIMIT,
        gen_kwargs={"max_gen_toks": NEW_TOKENS},
        apply_chat_template=True,
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def hf_lm(smollm2):
    # lm-eval's own HF model, loading the converted checkpoint by itself
    return HFLM(pretrained=str(cache_dir() / "models" / "smollm2-135m"), dtype="float32", device="cpu", batch_size=2)


@pytest.fixture(scope="module")
def hf_run(hf_lm, task_manager):
    return evaluate(hf_lm, task_manager)


@pytest.fixture(scope="module")
def full_lm(smollm2):
    model, tokenizer = smollm2
    return ReasonKVLM(model, tokenizer=tokenizer, batch_size=2)


@pytest.fixture(scope="module")
def full_run(full_lm, task_manager):
    return evaluate(full_lm, task_manager)


@pytest.fixture(scope="module")
def evicting_run(tmp_path_factory) -> dict:
    """An evicting policy through `reasonkv lm-eval` (lm-eval's command line), read back from its output files
    in the shape ``simple_evaluate`` returns."""
    out = tmp_path_factory.mktemp("lm-eval")
    args = ["lm-eval", "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "--gen_kwargs", f"max_gen_toks={NEW_TOKENS}"]
    args += ["--model_args", f"pretrained=smollm2-135m,policy=streaming,budget={BUDGET},buffer={BUFFER},policy.sinks=8"]
    args += ["--apply_chat_template", "--batch_size", "2", "--log_samples", "--output_path", str(out)]
    assert main(args) == 0
    [results] = out.rglob("results_*.json")
    run = json.loads(results.read_text())
    run["samples"] = {}
    for task in TASKS:
        [path] = out.rglob(f"samples_{task}_[0-9]*.jsonl")  # the date follows the task's name
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:  # the file spells each request's arguments {"gen_args_0": {"arg_0": ...}}, and numbers as text
            row["arguments"] = [tuple(request.values()) for request in row["arguments"].values()]
        run["samples"][task] = rows
    return run


def samples(run: dict, task: str) -> list[dict]:
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


def stats(sample: dict) -> dict:
    [[*_, annotation]] = sample["arguments"]
    [row] = annotation["reasonkv"]
    return row


def logprob(sample: dict) -> float:
    [[(value, _)]] = sample["resps"]
    return float(value)


def test_the_full_cache_gives_exactly_what_lm_evals_hf_model_gives(full_run, hf_run):
    ours, theirs = samples(full_run, "reasonkv_gsm8k"), samples(hf_run, "reasonkv_gsm8k")
    assert len(ours) == len(theirs) == LIMIT
    for a, b in zip(ours, theirs, strict=True):
        assert a["resps"] == b["resps"] and a["filtered_resps"] == b["filtered_resps"], a["doc_id"]
        assert a["resps"][0][0].strip()
        assert stats(a)["evictions"] == 0 and stats(a)["policy"] == "full"
    ours, theirs = samples(full_run, "reasonkv_gsm8k_reference"), samples(hf_run, "reasonkv_gsm8k_reference")
    for a, b in zip(ours, theirs, strict=True):
        [[(value, greedy)]], [[(expected, expected_greedy)]] = a["resps"], b["resps"]
        assert abs(value - expected) < 1e-4 and greedy == expected_greedy, a["doc_id"]
        assert stats(a)["scoring"] == "evicting" and stats(a)["continuation_tokens"] > 20
    for task in TASKS:
        for metric, value in hf_run["results"][task].items():
            if isinstance(value, float):
                assert full_run["results"][task][metric] == pytest.approx(value, abs=1e-4), (task, metric)
    assert full_run["config"]["reasonkv"]["policy"] == "full"


def test_an_evicting_policy_evicts_in_generation_and_in_scoring(full_run, evicting_run):
    generated = samples(evicting_run, "reasonkv_gsm8k")
    assert len(generated) == LIMIT
    assert all(stats(s)["prompt_tokens"] > BUDGET + BUFFER and stats(s)["evictions"] > 0 for s in generated)
    assert all(stats(s)["peak_row_tokens"] == stats(s)["prompt_tokens"] for s in generated)  # evicted after prefill
    # an output stops at NEW_TOKENS unless the model ended it; three prompts in batches of two: 2 + 1
    assert all((stats(s)["new_tokens"] == NEW_TOKENS) == (stats(s)["finish_reason"] == "length") for s in generated)
    assert all(0 < stats(s)["new_tokens"] <= NEW_TOKENS for s in generated)
    assert sorted(stats(s)["batch_size"] for s in generated) == [1, 2, 2]
    full = samples(full_run, "reasonkv_gsm8k")
    assert any(a["resps"] != b["resps"] for a, b in zip(generated, full, strict=True))
    scored, full = samples(evicting_run, "reasonkv_gsm8k_reference"), samples(full_run, "reasonkv_gsm8k_reference")
    for a, b in zip(scored, full, strict=True):
        assert stats(a)["scoring"] == "evicting" and stats(a)["evictions"] > 0
        assert abs(logprob(a) - logprob(b)) > 1e-3
    settings = evicting_run["config"]["reasonkv"]
    assert (settings["policy"], settings["budget"], settings["buffer"]) == ("streaming", BUDGET, BUFFER)
    assert settings["options"]["sinks"] == 8 and settings["scoring"] == "evicting"


def test_generations_are_what_reasonkv_generate_gives(evicting_run, smollm2):
    model, tokenizer = smollm2
    for sample in samples(evicting_run, "reasonkv_gsm8k"):
        [[prompt, _, _]] = sample["arguments"]
        row = stats(sample)
        [result] = reasonkv.generate(
            model,
            tokenizer,
            prompt,
            policy="streaming",
            budget=BUDGET,
            buffer=BUFFER,
            sinks=8,
            seed=row["seed"],
            max_new_tokens=NEW_TOKENS,
        )
        assert tokenizer.decode(result.token_ids, skip_special_tokens=True) == sample["resps"][0][0]
        assert result.stats["evictions"] == row["evictions"]


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("handmade", 0, 1))


CONTEXT = "Count the numbers from one to forty, in words:"
CONTINUATION = " " + ", ".join(["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"] * 3)


@pytest.mark.parametrize("policy", ["h2o", "vase-dkv"])  # fed in chunks between evictions / token by token
def test_scoring_holds_the_budget_and_moves_the_loglikelihood(smollm2, full_lm, policy):
    model, tokenizer = smollm2
    lm = ReasonKVLM(model, tokenizer=tokenizer, policy=policy, budget=BUDGET, buffer=BUFFER)
    item = request("loglikelihood", CONTEXT, CONTINUATION)
    [(evicted, _)] = lm.loglikelihood([item])
    [row] = item.args[-1]["reasonkv"]
    fed = row["context_tokens"] + row["continuation_tokens"] - 1  # the last continuation token is never fed
    assert row["context_tokens"] < BUDGET + BUFFER < fed
    assert row["peak_slots"] <= BUDGET + BUFFER
    assert row["evictions"] == (fed - (BUDGET + BUFFER)) // BUFFER + 1
    [(full, _)] = full_lm.loglikelihood([request("loglikelihood", CONTEXT, CONTINUATION)])
    assert abs(evicted - full) > 1e-3
    lm.scoring = "full"  # lm-eval's own full-context scoring: no eviction at all
    item = request("loglikelihood", CONTEXT, CONTINUATION)
    [(unevicted, _)] = lm.loglikelihood([item])
    assert unevicted == pytest.approx(full, abs=1e-4) and item.args[-1]["reasonkv"][0]["scoring"] == "full"


def test_rolling_loglikelihood_matches_hf_and_evicts(smollm2, full_lm, hf_lm):
    text = CONTEXT + CONTINUATION
    [ours] = full_lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    [theirs] = hf_lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert ours == pytest.approx(theirs, abs=1e-4)
    model, tokenizer = smollm2
    lm = ReasonKVLM(model, tokenizer=tokenizer, policy="streaming", budget=BUDGET, buffer=BUFFER)
    item = request("loglikelihood_rolling", text)
    [evicted] = lm.loglikelihood_rolling([item])
    [row] = item.args[-1]["reasonkv"]
    assert row["windows"] == 1 and row["evictions"] > 0 and abs(evicted - ours) > 1e-3


def test_bad_model_args_fail_at_start_with_one_line():
    # in a process of its own: lm-eval's command line sets its logging up on the stderr it first sees
    argv = ["lm-eval", "--tasks", "reasonkv_gsm8k", "--model_args", "policy=nope,budget=64", "--limit", "1"]
    done = subprocess.run([sys.executable, "-m", "reasonkv.cli", *argv], capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    err = done.stderr  # lm-eval's own log lines come first
    last = "reasonkv lm-eval: error: model_args policy='nope': unknown policy 'nope'; valid policies: "
    assert err.splitlines()[-1].startswith(last) and "Traceback" not in err and err.count("error:") == 1
    assert "Loading weights" not in err  # refused before the model loads


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ({"policy": "nope", "budget": 64}, "model_args policy='nope': unknown policy 'nope'; valid policies: "),
        ({"policy": "streaming", "budget": 2}, "4 protected tokens exceed the budget 2"),
        ({"policy": "streaming", "budget": 64, "policy.snks": 8}, "model_args policy.snks=8: policy 'streaming' has"),
    ],
)
def test_bad_model_args_are_refused_before_the_model_loads(model_args, message, monkeypatch):
    monkeypatch.setattr("reasonkv.integrations.lm_eval.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="^model_args") as caught:
        ReasonKVLM("smollm2-135m", **model_args)
    assert message in str(caught.value)
