r"""Answer grading: extraction, equivalence and the per-problem verdict.

``grade`` looks for the final answer (:mod:`reasonkv.eval.extraction`); the last-number fallback applies only
to an output that ended by itself, since the last number of an output cut off at the token limit is not an
answer (:func:`cut_off_guess`; :func:`counts_as_correct` applies the rule to records graded before it).
``is_equivalent`` tries cheap exact rules on normalised strings first (:func:`normalize_answer`), then asks
math-verify (bounded in time, thread-safe: :mod:`reasonkv.eval._symbolic`). Answers with several values
(``a, b`` or ``a \pm b``) must match value for value, in any order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from reasonkv.eval._symbolic import symbolic_equal
from reasonkv.eval.datasets import Problem
from reasonkv.eval.extraction import choice_letter, extract_answer, find_answer, find_boxed
from reasonkv.eval.prompts import strip_thinking

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Grade",
    "counts_as_correct",
    "cut_off_guess",
    "extract_answer",
    "grade",
    "is_equivalent",
    "normalize_answer",
]

DEFAULT_TIMEOUT_S = 10.0

# Spacing and sizing commands, dollar and percent signs; a backslash pair (a matrix row break) is kept.
_REMOVE_RE = re.compile(r"(?<!\\)\\(?:[,;:! $%]|left(?![A-Za-z])|right(?![A-Za-z])|displaystyle|q?quad)|[$%~]")
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_TEXT_CMD = r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|operatorname)\s*"
_WHOLE_TEXT_RE = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_UNIT_RE = re.compile(r"^(.*?\S)\s*" + _TEXT_CMD + r"\{\s*[A-Za-z][A-Za-z .]*\}\s*(?:\^\s*\{?\d\}?)?$")
_WORD_UNIT_RE = re.compile(r"^([-+]?[\d.,/]*\d)\s+[A-Za-z]{2,}[A-Za-z .]*$")  # "12 apples", not "3 x"
_ASSIGN_RE = re.compile(r"^[A-Za-z]\s*(?:=|\\in\b)\s*(?=\S)")
_TYPESET_THOUSANDS_RE = re.compile(r"(?<=\d),\s*\\!\s*(?=\d{3})")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_SLASH_RE = re.compile(r"([-+]?)(\d+)\s*/\s*(\d+)")
_ARG = r"(?:\{\s*(\d+)\s*\}|(\d))"
_FRAC_RE = re.compile(r"([-+]?)(?:(\d+)\s*)?\\frac\s*" + _ARG + r"\s*" + _ARG)
# Word answers need a run of 3+ letters, so short products of variables ("xy") stay symbolic.
_WORDS_RE = re.compile(r"(?=.*[A-Za-z]{3})[A-Za-z][A-Za-z '\-]*")
_LETTER_RE = re.compile(r"\(([A-Za-z])\)")
# What nests (brackets, and braces written \{ \}) and what separates values at the top level.
_SPLIT_RE = re.compile(r"\\[{}]|[()\[\]{},;]")
_PLAIN_NUMBER_RE = re.compile(r"\s*[-+]?\d[\d,]*(?:\.\d+)?\s*")


@dataclass(frozen=True)
class Grade:
    """Verdict for one output."""

    extracted: str | None  # the answer found, as written by the model
    correct: bool
    method: str  # the extraction path (:data:`reasonkv.eval.extraction.METHODS`)
    from_thinking: bool = False  # the text after </think> had no answer: it was taken from the thinking


def grade(output_text: str, problem: Problem, *, complete: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade a model output against a problem's reference answer.

    The answer is looked for after the last ``</think>`` first, and in the whole text only if
    nothing is found there. The last-number fallback is allowed only when the reference answer
    is a plain number (GSM8K style) and the output is ``complete`` (it ended by itself: an end of
    sequence or a stop string, not the token limit). When the reference has ``k > 1`` values and the
    last box alone does not match, the last ``k`` boxes are tried together.
    """
    last_number = complete and problem.kind == "math" and bool(_PLAIN_NUMBER_RE.fullmatch(problem.answer))
    searched = strip_thinking(output_text)
    pred, method = find_answer(searched, problem.kind, last_number=last_number)
    from_thinking = False
    if pred is None and len(searched) != len(output_text):
        searched = output_text
        pred, method = find_answer(searched, problem.kind, last_number=last_number)
        from_thinking = pred is not None
    correct = pred is not None and is_equivalent(pred, problem.answer, problem.kind, timeout_s=timeout_s)
    if not correct and method == "boxed" and problem.kind == "math":
        # A k-valued answer may be given as k separate boxes: "\boxed{a} and \boxed{b}".
        k = len(_split_values(normalize_answer(problem.answer)))
        boxes = find_boxed(searched)
        if k > 1 and len(boxes) >= k:
            joined = ", ".join(boxes[-k:])
            if is_equivalent(joined, problem.answer, timeout_s=timeout_s):
                pred, correct = joined, True
    return Grade(extracted=pred, correct=correct, method=method, from_thinking=from_thinking)


def cut_off_guess(record: Mapping[str, Any]) -> bool:
    """Whether a generation record's answer is the last number of an output cut off at the token limit."""
    return record.get("grading_method") == "last_number" and record.get("finish_reason") == "length"


def counts_as_correct(record: Mapping[str, Any]) -> bool:
    """Whether a generation record is correct: graded so, and not a :func:`cut_off_guess` (records graded
    before that rule may hold one)."""
    return record.get("correct") is True and not cut_off_guess(record)


def is_equivalent(pred: str | None, gold: str, kind: str = "math", *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether an extracted answer (``None`` is never correct) matches the reference ``gold``: option letters
    for ``kind="choice"``, values for ``"math"``. ``timeout_s`` bounds each symbolic check (a ``k``-valued answer
    makes at most ``k**2``)."""
    if pred is None or not pred.strip():
        return False
    if kind == "choice":
        letter = choice_letter(pred) or pred.strip().upper()
        return letter == (choice_letter(gold) or gold.strip().upper())
    if kind != "math":
        raise ValueError(f"kind must be 'math' or 'choice', got {kind!r}")
    p, g = normalize_answer(pred), normalize_answer(gold)
    if _key(p) == _key(g):
        return True
    pred_parts, gold_parts = _split_values(p), _split_values(g)
    if len(pred_parts) == 1 and len(gold_parts) == 1:
        return _single_equal(p, g, timeout_s)
    if len(pred_parts) != len(gold_parts):
        # "a, b" written without the parentheses of the tuple the reference asks for
        return len(gold_parts) == 1 and g.startswith("(") and _single_equal(f"({p})", g, timeout_s)
    return _match_all(pred_parts, gold_parts, timeout_s)


def normalize_answer(text: str) -> str:
    r"""Canonical form used before comparing: no math delimiters, spacing commands, units, degrees,
    percent or dollar signs; ``\dfrac``/``\tfrac`` -> ``\frac``; ``1,450,000`` -> ``1450000``;
    ``\text{Evelyn}`` -> ``Evelyn``; ``x = 5`` -> ``5``; ``\{1, 2\}`` -> ``1, 2``; ``(C)`` -> ``C``.
    """
    s = text.strip()
    for open_, close in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(open_) and s.endswith(close) and len(s) >= len(open_) + len(close):
            s = s[len(open_) : len(s) - len(close)].strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    # Thousands separators as typeset: "10,\!080", "1{,}000", "1\,000".
    s = _TYPESET_THOUSANDS_RE.sub(",", s).replace("{,}", ",")
    s = re.sub(r"(?<=\d)\\,(?=\d{3}(?!\d))", "", s)
    s = _REMOVE_RE.sub(" ", s).strip().rstrip(".").strip()
    s = _DEGREES_RE.sub("", s).strip()
    kept = _WHOLE_TEXT_RE.fullmatch(s) or _UNIT_RE.match(s) or _WORD_UNIT_RE.match(s)
    if kept:
        s = kept.group(1).strip()
    s = _ASSIGN_RE.sub("", s) if s.count("=") <= 1 else s
    if s.startswith("\\{") and s.endswith("\\}"):
        s = s[2:-2].strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    letter = _LETTER_RE.fullmatch(s)
    return letter.group(1) if letter else s


def _key(s: str) -> str:
    return re.sub(r"\s+", "", s)


def _as_number(s: str) -> Fraction | None:
    """Exact value of a plain number, decimal, ``a/b``, ``\\frac{a}{b}`` or mixed number."""
    s = s.strip()
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s)
        if (m := _SLASH_RE.fullmatch(s)) and int(m.group(3)):
            value = Fraction(int(m.group(2)), int(m.group(3)))
        elif (m := _FRAC_RE.fullmatch(s)) and int(m.group(5) or m.group(6)):
            value = Fraction(int(m.group(3) or m.group(4)), int(m.group(5) or m.group(6))) + int(m.group(2) or 0)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m.group(1) == "-" else value


def _single_equal(p: str, g: str, timeout_s: float) -> bool:
    if _key(p) == _key(g):
        return True
    p_num, g_num = _as_number(p), _as_number(g)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    if _WORDS_RE.fullmatch(p) and _WORDS_RE.fullmatch(g):
        # Word answers ("east", "Evelyn"); sympy would read them as products of symbols.
        return p.strip().lower() == g.strip().lower()
    return symbolic_equal(p, g, timeout_s)


def _split_values(s: str) -> list[str]:
    r"""Top-level values of ``a, b``, ``a; b``, ``a \text{ and } b``; ``a \pm b`` gives two."""
    s = re.sub(r"\\text\{\s*(?:and|or)\s*\}|\s(?:and|or)\s", ",", s)
    parts, depth, start = [], 0, 0
    for match in _SPLIT_RE.finditer(s):
        token = match.group()
        if token in ",;" and depth == 0:
            parts.append(s[start : match.start()])
            start = match.end()
        elif token not in ",;":
            depth += 1 if token[-1] in "([{" else -1
    parts.append(s[start:])
    values: list[str] = []
    for part in parts:
        part = normalize_answer(part)
        if not part:
            continue
        pm = re.search(r"\\(pm|mp)(?![A-Za-z])", part)
        if pm:
            first, second = ("+", "-") if pm.group(1) == "pm" else ("-", "+")
            values += [part[: pm.start()] + first + part[pm.end() :], part[: pm.start()] + second + part[pm.end() :]]
        else:
            values.append(part)
    return values or [s]


def _match_all(pred_parts: list[str], gold_parts: list[str], timeout_s: float) -> bool:
    """Every gold value matched by a distinct predicted value (order free)."""
    if not gold_parts:
        return not pred_parts
    first, rest = gold_parts[0], gold_parts[1:]
    for i, candidate in enumerate(pred_parts):
        if _single_equal(candidate, first, timeout_s) and _match_all(
            pred_parts[:i] + pred_parts[i + 1 :], rest, timeout_s
        ):
            return True
    return False
