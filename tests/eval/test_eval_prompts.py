from __future__ import annotations

import pytest

from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.prompts import build_prompt, strip_thinking

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# R1-distill style: no enable_thinking; the template pre-fills "<think>\n" (older ones let the model open it).
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)


def _tokenizer(template: str | None):
    vocab = {"[UNK]": 0, "<s>": 1, "<think>": 2, "</think>": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", bos_token="<s>")
    tok.chat_template = template
    return tok


MATH = Problem(id="m", problem="What is $1+1$?", answer="2", source="t")
CHOICE = Problem(id="c", problem="Pick one.\n\nA) x\nB) y\nC) z\nD) w", answer="B", source="t", kind="choice")


def test_math_prompt_uses_template_and_instruction():
    text = build_prompt(_tokenizer(QWEN3_TEMPLATE), MATH)
    assert text.startswith("<|im_start|>user\nWhat is $1+1$?")
    assert "Please reason step by step, and put the final answer in \\boxed{}.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # thinking left to the template's default


def test_choice_prompt_asks_for_boxed_letter():
    text = build_prompt(_tokenizer(QWEN3_TEMPLATE), CHOICE)
    assert "D) w\n\n" in text
    assert "letter of the correct option" in text and "\\boxed{B}" in text


def test_enable_thinking_passed_when_supported():
    tok = _tokenizer(QWEN3_TEMPLATE)
    assert build_prompt(tok, MATH, thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert build_prompt(tok, MATH, thinking=True).endswith("assistant\n")


@pytest.mark.parametrize("thinking", [None, True, False])
def test_r1_template_not_given_enable_thinking(thinking, monkeypatch):
    tok = _tokenizer(R1_TEMPLATE)
    calls = []
    original = tok.apply_chat_template

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    text = build_prompt(tok, MATH, thinking=thinking)
    assert "enable_thinking" not in calls[0] and calls[0]["add_generation_prompt"] is True
    assert text.startswith("<s><|User|>What is $1+1$?")
    assert text.endswith("<|Assistant|><think>\n")


def test_plain_fallback_without_template():
    text = build_prompt(_tokenizer(None), MATH)
    assert text == (
        "Problem: What is $1+1$?\n\nPlease reason step by step, and put the final answer in \\boxed{}.\nSolution:"
    )
    assert build_prompt(object(), "2+2?").startswith("Problem: 2+2?\n\n")


def test_bundled_problem_prompt():
    [problem] = load_dataset("hmmt25", limit=1)
    assert problem.problem in build_prompt(_tokenizer(QWEN3_TEMPLATE), problem)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>try \\boxed{3}</think>The answer is \\boxed{4}.", "The answer is \\boxed{4}."),
        ("reasoning...</think>\n\nfinal", "\n\nfinal"),  # R1: the prompt opened <think>
        ("a</think>b</think>c", "c"),
        ("no thinking here \\boxed{1}", "no thinking here \\boxed{1}"),
        ("<think>cut off while thinking \\boxed{2}", "<think>cut off while thinking \\boxed{2}"),
        ("</think>", ""),
    ],
)
def test_strip_thinking(text, expected):
    assert strip_thinking(text) == expected
