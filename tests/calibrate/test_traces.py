"""Traces (tidying, answer spans, token spans, the prompt's ids) and the resumable record store."""

from __future__ import annotations

import json
import math

import pytest

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.calibrate import traces
from reasonkv.calibrate.store import RecordStore
from reasonkv.calibrate.traces import generated_trace, prompt_ids, reference_trace, tidy_reference
from reasonkv.eval.datasets import Problem
from reasonkv.eval.prompts import build_prompt
from reasonkv.eval.references import answer_span as answer_char_span
from reasonkv.eval.references import token_span
from reasonkv.generation import GenerationResult

SOLUTION = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
)


def test_tidy_reference_drops_calculator_notes_and_boxes_the_answer():
    text = tidy_reference(SOLUTION)
    assert "<<" not in text and "####" not in text
    assert text.endswith("every day.\nThe final answer is \\boxed{18}.")
    start, end = answer_char_span(text)
    assert text[start:end] == "18" and text[end] == "}"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{1} then \\boxed{ \\frac{1}{2} }.", "\\frac{1}{2}"),
        ("steps\n#### 1,234", "1,234"),
        ("it is 12 then 40.5 apples", "40.5"),
    ],
)
def test_answer_char_span(text, answer):
    start, end = answer_char_span(text)
    assert text[start:end] == answer


def test_answer_char_span_none():
    assert answer_char_span("no answer here") is None


def test_token_span_without_offsets_uses_prefix_encodings():
    tokenizer = NoEosTokenizer()  # one token per character, no offset mapping
    text = "abc \\boxed{42}."
    ids, span = token_span(tokenizer, text, answer_char_span(text))
    assert len(ids) == len(text) and span == (11, 13)


def test_reference_trace_and_cut():
    problem = Problem(id="p", problem="What?", answer="18", source="t", solution=SOLUTION)
    tokenizer = NoEosTokenizer()
    trace = reference_trace(tokenizer, problem)
    assert (
        trace.prompt_ids
        == tokenizer("Problem: What?\n\nPlease reason step by step, and put the final answer in \\boxed{}.\nSolution:")[
            "input_ids"
        ]
    )
    assert tokenizer.decode(trace.trace_ids[slice(*trace.answer_span)]) == "18"
    assert trace.ids == trace.prompt_ids + trace.trace_ids
    cut = reference_trace(tokenizer, problem, max_tokens=10)
    assert len(cut.trace_ids) == 10 and cut.answer_span is None
    with pytest.raises(ValueError, match="has no reference solution"):
        reference_trace(tokenizer, Problem(id="q", problem="x", answer="1", source="t"))


def test_record_store_resumes_and_checks_settings(tmp_path):
    path = tmp_path / "r.jsonl"
    store = RecordStore(path, {"a": 1})
    store.append({"id": "x", "values": [1.0, math.nan]})
    store.append({"id": "y", "values": [2.0]})
    assert json.loads(path.read_text().splitlines()[0])["values"] == [1.0, None]
    with path.open("a") as handle:
        handle.write('{"id": "z", "val')  # torn by an interruption
    again = RecordStore(path, {"a": 1})
    assert sorted(again.records) == ["x", "y"] and "z" not in again
    assert len(path.read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="other settings .*a: 1 there, 2 now"):
        RecordStore(path, {"a": 2})
    replaced = RecordStore(path, {"a": 2}, on_mismatch="replace")
    assert len(replaced) == 0 and not path.exists()


def test_generated_trace_is_the_models_greedy_continuation():
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    problem = Problem(id="g", problem="1+1?", answer="2", source="t")
    trace = generated_trace(model, tokenizer, problem, max_new_tokens=12)
    [result] = reasonkv.generate(model, tokenizer, [trace.prompt_ids], policy="full", max_new_tokens=12)
    assert trace.trace_ids == result.token_ids and trace.source == "generated"
    text = tokenizer.decode(trace.trace_ids)
    span = answer_char_span(text)
    if span is None:
        assert trace.answer_span is None
    else:  # one character per token: the token span is the character span
        assert trace.answer_span == span


def test_generated_trace_maps_the_answer_to_tokens(monkeypatch):
    tokenizer = NoEosTokenizer()
    text = "so \\boxed{42}."
    ids = tokenizer(text)["input_ids"] + [2]  # ends with the end-of-sequence token

    def fake_generate(model, tok, prompts, **kwargs):
        return [GenerationResult(text=text, token_ids=ids, prompt_tokens=len(prompts[0]), finish_reason="eos")]

    monkeypatch.setattr(traces, "generate", fake_generate)
    problem = Problem(id="g", problem="1+1?", answer="2", source="t")
    trace = generated_trace(None, tokenizer, problem, max_new_tokens=12)
    assert trace.trace_ids == ids[:-1] and trace.answer_span == (10, 12)


@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m['content'] }}{% endfor %}", "bos"])
def test_a_prompt_holds_one_bos_whether_the_chat_template_writes_it_or_not(template):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "<s>": 1}, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", bos_token="<s>")
    if template == "bos":
        template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.chat_template = template
    problem = Problem(id="p", problem="What is 1 + 1 ?", answer="2", source="t", solution="1 + 1 = 2 . #### 2")
    text = build_prompt(tokenizer, problem)
    assert text.startswith("<s>") == (template is not None and "bos_token" in template)
    ids = prompt_ids(tokenizer, problem)
    assert ids[0] == 1 and ids.count(1) == 1
    assert reference_trace(tokenizer, problem).prompt_ids == ids
