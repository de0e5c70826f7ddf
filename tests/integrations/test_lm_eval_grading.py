"""The lm-eval tasks grade as ``reasonkv eval`` does: never the last number of an output cut off at the limit."""

from __future__ import annotations

import copy
import json
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")

from reasonkv.integrations.lm_eval import ReasonKVLM  # noqa: E402
from reasonkv.integrations.lm_eval_tasks import Generation, process_generation  # noqa: E402

# A GSM8K document whose answer is 3; the output lists steps and is cut off right after a list item "3."
DOC = {"id": "gsm8k-0", "problem": "How many?", "answer": "3", "kind": "math"}
LIST_ITEM = "Let us count:\n1. first apples\n2. then pears\n3."


@pytest.mark.parametrize(("finish_reason", "expected"), [("length", 0.0), ("eos", 1.0), ("stop", 1.0), (None, 0.0)])
def test_the_last_number_counts_only_for_an_output_that_ended_by_itself(finish_reason, expected):
    text = LIST_ITEM if finish_reason is None else Generation(LIST_ITEM, finish_reason)
    assert process_generation(DOC, [text]) == {"exact_match": expected}


def test_a_boxed_answer_counts_whatever_the_ending():
    for finish_reason in ("length", "eos"):
        text = Generation("so the answer is \\boxed{3} and then", finish_reason)
        assert process_generation(DOC, [text]) == {"exact_match": 1.0}


def test_the_models_text_carries_how_decoding_ended():
    model = SimpleNamespace(think_end_token=None, tok_decode=lambda tokens: "".join(map(str, tokens)))
    result = SimpleNamespace(token_ids=[1, 2, 3], finish_reason="length")
    text = ReasonKVLM._text(model, result, until=["2"])  # cut at the stop string as lm-eval's hf model does
    assert text == "1" and isinstance(text, Generation) and text.finish_reason == "length"


def test_a_generation_survives_what_lm_eval_does_with_responses():
    text = Generation("so 3.", "length")
    for kept in (copy.deepcopy(text), pickle.loads(pickle.dumps(text))):  # its cache pickles responses
        assert kept == "so 3." and kept.finish_reason == "length"
    assert json.dumps({"resps": [[text]]}) == '{"resps": [["so 3."]]}'  # logged samples hold the text
