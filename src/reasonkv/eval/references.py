r"""Reference solutions as token sequences (for fidelity and layer anatomy): clean them, find their final
answer, map it to tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from reasonkv.eval.extraction import brace_span

__all__ = ["clean_solution", "box_final_answer", "answer_span", "token_span"]

_CALCULATOR = re.compile(r"<<[^<>]*>>")
_HASH_ANSWER = re.compile(r"(?m)^[ \t]*####[ \t]*(.+?)[ \t]*$")
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def clean_solution(solution: str) -> str:
    """The solution as fed to a model: GSM8K's ``<<a*b=c>>`` calculator notes removed."""
    return _CALCULATOR.sub("", solution).strip()


def box_final_answer(text: str) -> str:
    r"""Turn GSM8K's final ``#### X`` line into ``The final answer is \boxed{X}.`` (what a model writes)."""
    matches = list(_HASH_ANSWER.finditer(text))
    if not matches:
        return text
    match = matches[-1]
    return f"{text[: match.start()]}The final answer is \\boxed{{{match.group(1)}}}.{text[match.end() :]}".strip()


def answer_span(text: str, answer: str | None = None) -> tuple[int, int] | None:
    r"""Character span ``[start, end)`` of the final answer of a solution, None if none is found: the text after
    the last ``####``, else the last ``\boxed{}``/``\fbox{}``'s content, else the last ``answer`` (a whole number
    when it is one) or, without one, the last number."""
    hashes = list(_HASH_ANSWER.finditer(text))
    if hashes:
        return hashes[-1].span(1)
    spans = [brace_span(text, match.end() - 1) for match in _BOXED.finditer(text)]
    boxed = next((span for span in reversed(spans) if span is not None and span[0] < span[1]), None)
    if boxed:
        return boxed
    if answer is None or not answer.strip():
        numbers = list(_NUMBER.finditer(text))
        return numbers[-1].span() if numbers else None
    needle = answer.strip()
    if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", needle):
        found = list(re.finditer(rf"(?<![\d.]){re.escape(needle)}(?![\d])", text))
        return found[-1].span() if found else None
    index = text.rfind(needle)
    return (index, index + len(needle)) if index >= 0 else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_span(tokenizer: Any, text: str, span: tuple[int, int] | None) -> tuple[list[int], tuple[int, int] | None]:
    """Tokenize ``text`` (no special tokens) and map a character span to ``[start, end)`` token indices: by the
    offset mapping, else where the tokens of the text before each end stop being a prefix of the text's."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded.get("offset_mapping")
    except (TypeError, NotImplementedError, ValueError):
        encoded, offsets = tokenizer(text, add_special_tokens=False), None
    ids = list(encoded["input_ids"])
    if span is None:
        return ids, None
    start_char, end_char = span
    if offsets is not None and len(offsets) == len(ids):
        hits = [i for i, (a, b) in enumerate(offsets) if a < end_char and b > start_char]
        return ids, (hits[0], hits[-1] + 1) if hits else None
    start = _common_prefix(ids, _encode(tokenizer, text[:start_char]))
    head = _encode(tokenizer, text[:end_char])
    shared = _common_prefix(ids, head)
    end = shared + (shared < len(head))
    return ids, (start, min(max(end, start + 1), len(ids)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
